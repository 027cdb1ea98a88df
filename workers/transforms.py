"""The request's transform on a worker (docs/design.md §3.9): the grammar engine, grammars compiled off the model thread, each session's transform."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from core.errors import InvalidRequest
from core.grammar import GrammarLimits, Grammars, GrammarSpec
from core.runners import ModelRunner
from core.transform import Transformer, TransformSpec
from workers.sessions import SessionStore
from workers.settings import WorkerSettings

Shaping = tuple[Transformer, list[int], list[list[int]]]  # a call's transform, its agreed tokens, each scored row's path after them


def shaped(rows: torch.Tensor, shaping: Shaping | None) -> torch.Tensor:
    """``rows`` each transformed by its own prefix (docs/design.md §3.9), when the call has a transform."""
    if shaping is None:
        return rows
    transformer, agreed, paths = shaping
    return transformer.rows(rows, agreed, paths)


class Transforms:
    """Each session's transform, and the grammar engine they compile with (built on first use)."""

    def __init__(self, settings: WorkerSettings, runner: ModelRunner, sessions: SessionStore) -> None:
        self.settings, self.runner, self.sessions = settings, runner, sessions
        self._grammars: Grammars | None = None

    def transformer(self, wire: dict[str, Any]) -> Transformer:
        try:
            spec = TransformSpec.from_wire(wire)
            return Transformer.build(spec, self.runner.info.vocab_size, self.grammars() if spec.grammar is not None else None)
        except ValueError as exc:  # GrammarError included
            raise InvalidRequest(str(exc), param="transform") from exc

    def start_transform(self, session_id: str, wire: dict[str, Any] | None) -> None:
        """A call that starts a session (prefix_len 0) sets its transform (docs/design.md §3.9), or none."""
        self.sessions.transforms.pop(session_id, None)
        if wire is not None:
            self.sessions.transforms[session_id] = self.transformer(wire)

    async def precompile(self, wire: dict[str, Any] | None, starts: bool) -> None:
        """Compile a starting call's grammar into the engine's cache off the model thread, so its batch-mates do not wait for it."""
        if not starts or not isinstance(wire, dict) or "grammar" not in wire:
            return
        try:
            spec = GrammarSpec.from_wire(wire["grammar"])
            await asyncio.to_thread(lambda: self.grammars().compile(spec))
        except ValueError as exc:  # GrammarError included
            raise InvalidRequest(f"transform: {exc}", param="transform") from exc

    def grammars(self) -> Grammars:
        """The grammar engine over this model's tokenizer (built on first use: ~0.25 s)."""
        if self._grammars is None:
            info = self.runner.info
            self._grammars = Grammars(self.runner.tokenizer, info.vocab_size, info.eos_ids, GrammarLimits(max_source_bytes=self.settings.max_grammar_bytes))
        return self._grammars

