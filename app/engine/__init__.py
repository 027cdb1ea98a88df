"""The decoding engine (docs/design.md §3): ``loop``, ``spec`` (what a request asks and a round gives),
``round``, ``strategies``."""

from app.engine.loop import Engine
from app.engine.round import token_logprobs
from app.engine.spec import GenerationRequest, RoundResult, SpecOptions, TokenLogprob

__all__ = ["Engine", "GenerationRequest", "RoundResult", "SpecOptions", "TokenLogprob", "token_logprobs"]
