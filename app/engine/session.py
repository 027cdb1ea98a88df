"""One choice in progress (docs/design.md §3): the agreed tokens, what each target holds of them, the room
left and the finish."""

from __future__ import annotations

from dataclasses import dataclass, replace

from app.adaptive import GammaController
from app.engine.spec import GenerationRequest, RoundResult
from core.math.random import round_seed
from core.math.tree import TokenTree
from core.transform import LogitsTransform


@dataclass
class Session:
    """``agreed[n]``: the tokens of ``sequence`` target n holds; ``path``: the last tree round's accepted
    nodes (v1.1 ``path``). ``transformer``: the draft's side of the transform; ``verifier``: the gateway's own
    copy for a round's masks (the draft's runs ahead with overlap); ``auto``: the γ controller of
    ``num_draft_tokens: auto``."""

    id: str
    req: GenerationRequest
    sequence: list[int]
    agreed: list[int]
    max_context: int
    eos_ids: set[int]
    transformer: LogitsTransform | None = None
    verifier: LogitsTransform | None = None
    auto: GammaController | None = None
    path: list[int] | None = None
    rounds: int = 0  # verified so far
    finished: bool = False

    @property
    def generated(self) -> int:
        return len(self.sequence) - len(self.req.prompt)

    @property
    def output(self) -> list[int]:
        return self.sequence[len(self.req.prompt) :]

    def room(self) -> int:
        """Tokens the choice may still emit (its max_tokens, the context)."""
        return min(self.req.max_tokens - self.generated, self.max_context - len(self.sequence))

    def gamma(self) -> int:
        """The γ this round asks for (the controller's, or the request's)."""
        return self.auto.choose() if self.auto is not None else self.req.spec.num_draft_tokens

    def keyed(self, ahead: int = 0) -> GenerationRequest:
        """The request as round ``rounds + ahead`` draws with it: its own seed under ``num_draft_tokens:
        auto`` (``round_seed``)."""
        return (
            replace(self.req, seed=round_seed(self.req.seed, self.rounds + ahead))
            if self.auto is not None
            else self.req
        )

    def commit(self, result: RoundResult, draft: TokenTree | None = None) -> RoundResult:
        """The round's tokens join the sequence; after a verified ``draft`` targets hold a chain's accepted
        tokens, or a tree's path (kept when named)."""
        if draft is not None:
            self.rounds += 1
            self.path = result.path if not draft.is_chain else None
            self.agreed[:] = [
                len(self.sequence) + (result.accepted if draft.is_chain else len(self.path or ()))
            ] * len(self.agreed)
        self.sequence.extend(result.tokens)
        result.finish_reason = finish_reason(
            result, self.generated, len(self.sequence), self.req, self.eos_ids, self.max_context
        )
        self.finished = result.finish_reason is not None
        return result


def finish_reason(
    result: RoundResult,
    generated: int,
    length: int,
    req: GenerationRequest,
    eos_ids: set[int],
    max_context: int,
) -> str | None:
    """ "stop" at an EOS the round emitted (cut after it), "length" at max_tokens or the context; None while
    generating."""
    for i, token in enumerate(result.tokens):
        if token in eos_ids and not req.ignore_eos:
            del result.tokens[i + 1 :]
            if result.logprobs is not None:
                del result.logprobs[i + 1 :]
            return "stop"
    if generated >= req.max_tokens or length >= max_context:
        return "length"
    return None
