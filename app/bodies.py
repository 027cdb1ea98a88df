"""Every OpenAI response and chunk the gateway sends (docs/design.md §5), built once; usage with our
``speculative`` block beside vLLM's ``metrics``."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from app.engine import TokenLogprob
from app.gateway import ChoiceEvent
from app.requests import Job
from app.tools import message_of


class Logprobs:
    """Logprobs as OpenAI writes them, over the gateway's tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def completion(self, job: Job, logprobs: list[TokenLogprob] | None, offset: int) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        offsets = list(itertools.accumulate([len(self._piece(lp.token)) for lp in logprobs], initial=offset))[
            :-1
        ]
        name = self._namer(job)
        return {
            "tokens": [name(lp.token) for lp in logprobs],
            # None for an echoed prompt's first token, as vLLM
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [None if lp.top is None else {name(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }

    def chat(self, job: Job, logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        name = self._namer(job)

        def entry(token: int, logprob: float) -> dict[str, Any]:
            return {
                "token": name(token),
                "logprob": logprob,
                "bytes": list(self._piece(token).encode("utf-8")),
            }

        # the tokens join to message.content, as OpenAI's do: a special token (the end of the
        # turn, <|im_end|>) is not in the content, so it is not in its logprobs either
        special = self._special_ids
        content = [
            {**entry(lp.token, lp.logprob or 0.0), "top_logprobs": [entry(t, v) for t, v in lp.top or []]}
            for lp in logprobs
            if lp.token not in special
        ]
        return {"content": content, "refusal": None}  # OpenAI's schema requires refusal (null here)

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        """What the detokenizer leaves out of the text (``skip_special_tokens``)."""
        return frozenset(int(t) for t in getattr(self.tokenizer, "all_special_ids", []))

    def _namer(self, job: Job) -> Callable[[int], str]:
        """How a token is named in logprobs: its text, or ``token_id:N`` (vLLM's
        return_tokens_as_token_ids)."""
        return (lambda token: f"token_id:{token}") if job.tokens_as_ids else self._piece

    def _piece(self, token: int) -> str:
        return str(self.tokenizer.decode([token]))


def usage(job: Job) -> dict[str, Any]:
    """``usage`` (with our ``speculative`` block) and, beside it, vLLM's ``metrics``."""
    metrics = job.usage.vllm_metrics()
    return {"usage": job.usage.to_dict(), **({"metrics": metrics} if metrics else {})}


def envelope(job: Job) -> dict[str, Any]:
    kind = "chat.completion.chunk" if job.id.startswith("chatcmpl") else "text_completion"
    return {"id": job.id, "object": kind, "created": job.created, "model": job.model}


def completion_body(logprobs: Logprobs, job: Job) -> Callable[[list[ChoiceEvent]], dict[str, Any]]:
    offset = 0 if job.echo_logprobs else len(job.prompt_text)

    def build(events: list[ChoiceEvent]) -> dict[str, Any]:
        choices = [
            {
                "index": e.index,
                "text": job.prompt_text + e.text,
                "logprobs": logprobs.completion(job, e.logprobs, offset),
                "finish_reason": e.finish_reason,
            }
            for e in events
        ]
        return {**envelope(job), "choices": choices, **usage(job)}

    return build


def chat_body(logprobs: Logprobs, job: Job) -> Callable[[list[ChoiceEvent]], dict[str, Any]]:
    def message(e: ChoiceEvent) -> dict[str, Any]:
        if e.deltas is None:
            return {"role": "assistant", "content": e.text, "refusal": None}
        return message_of(e.deltas)  # what the stream's deltas add up to (tools)

    def build(events: list[ChoiceEvent]) -> dict[str, Any]:
        choices = [
            {
                "index": e.index,
                "message": message(e),
                "logprobs": logprobs.chat(job, e.logprobs),
                "finish_reason": e.finish_reason,
            }
            for e in events
        ]
        return {**envelope(job), "object": "chat.completion", "choices": choices, **usage(job)}

    return build


def completion_chunks(logprobs: Logprobs, job: Job) -> Callable[[ChoiceEvent | None], list[dict[str, Any]]]:
    offsets = {c.choice: len(job.prompt_text) for c in job.choices}
    head = envelope(job)

    def build(event: ChoiceEvent | None) -> list[dict[str, Any]]:
        if event is None:  # the echoed prompt, before any token (with its logprobs: when they come)
            echoed = job.prompt_text and not job.echo_logprobs
            return [_chunk(head, c.choice, text=job.prompt_text) for c in job.choices] if echoed else []
        if event.is_prompt:
            return [
                _chunk(head, event.index, logprobs.completion(job, event.logprobs, 0), text=job.prompt_text)
            ]
        formatted = logprobs.completion(job, event.logprobs, offsets[event.index])
        offsets[event.index] += len(event.text)
        if not event.text and not event.finish_reason and not event.logprobs:
            return []
        return [
            {
                **_chunk(head, event.index, formatted, event.finish_reason, text=event.text),
                **round_field(event),
            }
        ]

    return build


def chat_chunks(logprobs: Logprobs, job: Job) -> Callable[[ChoiceEvent | None], list[dict[str, Any]]]:
    head = envelope(job)

    def deltas(event: ChoiceEvent) -> list[dict[str, Any]]:
        """The event's text as deltas: itself, or (tools) the generic format read into OpenAI's shapes."""
        if event.deltas is not None:
            return event.deltas
        return [{"content": event.text}] if event.text else []

    def build(event: ChoiceEvent | None) -> list[dict[str, Any]]:
        if event is None:  # one role delta per choice index, first
            # a call has no content
            return [
                _chunk(head, c.choice, delta={"role": "assistant", "content": None if job.tools else ""})
                for c in job.choices
            ]
        out = []
        pieces = deltas(event)
        if event.logprobs and not pieces:
            pieces = [{"content": ""}]
        for i, delta in enumerate(pieces):
            formatted = logprobs.chat(job, event.logprobs) if i == 0 else None
            out.append(
                {
                    **_chunk(head, event.index, formatted, delta=delta),
                    **(round_field(event) if i == 0 else {}),
                }
            )
        if event.finish_reason:
            out.append(_chunk(head, event.index, None, event.finish_reason, delta={}))
        return out

    return build


def _chunk(
    head: dict[str, Any], index: int, logprobs: Any = None, finish: str | None = None, **body: Any
) -> dict[str, Any]:
    """A stream chunk of one choice: ``body`` is its text (completions) or delta (chat)."""
    return {**head, "choices": [{"index": index, **body, "logprobs": logprobs, "finish_reason": finish}]}


def round_field(event: ChoiceEvent) -> dict[str, Any]:
    """The stream extension ``"speculative"``: what the chunk's round did (OpenAI clients ignore it; the chat
    page colours text with it)."""
    return {"speculative": asdict(event.round)} if event.round is not None else {}
