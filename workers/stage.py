"""A pipeline stage (docs/design.md §3.7): messages kept, checked, taken in ``seq`` order; the last answers
the payload, another sends states on."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import numpy as np
import torch

from core.errors import ContextOverflow, InvalidRequest, SessionShort
from core.protocol import StageRequest, StageResponse, check_stage_request
from core.runners import ModelRunner
from core.runners.base import ForwardItem, common_prefix
from workers.scoring import RowSpec, score_rows
from workers.sessions import SessionStore, Shaping, Transforms, shaped
from workers.settings import WorkerSettings


class StageSide:
    """A pipeline stage's side of a step (``workers.step.Steps`` runs it): a segment checked and prepared, its
    rows kept, its answer."""

    def __init__(
        self,
        settings: WorkerSettings,
        runner: ModelRunner,
        sessions: SessionStore,
        transforms: Transforms,
        counters: defaultdict[str, float],
    ) -> None:
        self.settings, self.runner, self.sessions, self.transforms, self.counters = (
            settings,
            runner,
            sessions,
            transforms,
            counters,
        )

    @property
    def max_context(self) -> int:
        return min(self.settings.max_context, self.runner.info.max_context)

    def prepare(self, req: StageRequest) -> tuple[ForwardItem, int, None]:
        """A stage's segment: keep the rows that survive, check the rows held, the item to run."""
        self.keep(req)
        if not len(req.tokens):
            raise InvalidRequest(
                "a stage forward appends at least one row (a prune alone goes to /v1/stage/keep)",
                param="tokens",
            )
        if req.prefix_len + len(req.tokens) > self.max_context:
            raise ContextOverflow(
                f"the session would hold {req.prefix_len + len(req.tokens)} rows, the context is "
                f"{self.max_context}",
                param="tokens",
            )
        self.sessions.admit(req.session_id, tree=True)
        if req.prefix_len == 0 and self.runner.is_last_stage:
            # the session's transform, set by the message that starts it
            self.transforms.start_transform(req.session_id, req.transform)
        hidden = torch.from_numpy(np.array(req.hidden, dtype=np.float32)) if req.hidden is not None else None
        scored = list(range(req.score_from, len(req.tokens))) or [len(req.tokens) - 1]
        parents = req.parents.tolist() if req.parents is not None else None
        return (
            ForwardItem(req.session_id, req.prefix_len, req.tokens.tolist(), parents, scored, hidden),
            0,
            None,
        )

    def shaping(self, req: StageRequest, held: int, scored: int) -> Shaping | None:
        """The last stage's ``_shaping``: the transform, and each scored row's prefix (its ancestors' tokens
        and its own), shared part split off."""
        transformer = self.sessions.transforms.get(req.session_id)
        if transformer is None:
            return None
        first = held - len(req.tokens) + req.score_from
        contexts = [self.runner.context(req.session_id, row) for row in range(first, first + scored)]
        agreed = contexts[0][: common_prefix(*contexts)]
        return transformer, agreed, [c[len(agreed) :] for c in contexts]

    def keep(self, req: StageRequest) -> int:
        """Apply a stage message's ``keep``; the rows held, which must be ``prefix_len`` (else 409)."""
        check_stage_request(
            req, self.runner.info.vocab_size, self.runner.hidden_size, self.runner.is_first_stage
        )
        held = self.runner.length(req.session_id) if req.session_id in self.sessions else 0
        if req.keep is not None and held:
            try:
                self.runner.keep(req.session_id, req.keep.tolist())
            except ValueError as exc:
                raise InvalidRequest(f"keep: {exc}", param="keep") from exc
            held = self.runner.length(req.session_id)
        if held != req.prefix_len:
            raise SessionShort(
                req.session_id, held, f"the stage holds {held} rows, the call assumes {req.prefix_len}"
            )
        return held

    def answer(self, req: StageRequest, output: torch.Tensor, model_ms: float) -> StageResponse | StageStates:
        """The last stage's payload at the scored rows; another stage's states, to send on."""
        held = self.runner.length(req.session_id)
        self.counters["positions_scored"] += len(req.tokens) - req.score_from
        if not self.runner.is_last_stage:
            return StageStates(output, model_ms, held)
        resp = StageResponse(
            held=held, stage_ms=np.array([model_ms], np.float32), hop_bytes=np.zeros(0, np.int32)
        )
        if req.score_from >= len(req.tokens):
            return resp
        scored = score_rows(
            shaped(output, self.shaping(req, held, len(output))), RowSpec.of(req), held, model_ms
        )
        return replace(
            resp,
            probs=scored.probs,
            tail_mass=scored.tail_mass,
            ids=scored.ids,
            recon_error=scored.recon_error,
            probs_dtype=scored.probs_dtype,
        )


@dataclass
class StageStates:
    """A stage's output before the last: the new rows' states, to send on."""

    states: torch.Tensor  # [t, hidden]
    model_ms: float
    held: int


class StageOrder:
    """Each session's stage messages in ``seq`` order: they come by different paths (the stage before, the
    gateway) and may overtake each other."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}
        self._changed = asyncio.Condition()

    @asynccontextmanager
    async def turn(self, session_id: str, seq: int, wait_s: float) -> AsyncIterator[None]:
        """Held from when every earlier message of the session was taken until this one is; 409 if ``seq`` was
        taken or they miss ``wait_s``."""
        async with self._changed:
            if seq < self._next.get(session_id, 0):
                raise SessionShort(
                    session_id, 0, f"message {seq} came after message {self._next[session_id] - 1}"
                )
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self._next.get(session_id, 0) == seq), wait_s
                )
            except TimeoutError:
                raise SessionShort(
                    session_id,
                    0,
                    f"message {seq} waited {wait_s:g} s for message {self._next.get(session_id, 0)}",
                ) from None
        try:
            yield
        finally:
            async with self._changed:
                self._next[session_id] = max(self._next.get(session_id, 0), seq + 1)
                self._changed.notify_all()

    def forget(self, session_id: str) -> None:
        self._next.pop(session_id, None)
