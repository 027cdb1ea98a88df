"""A pipeline as a target (docs/design.md §3.7): a model's layers over stage workers in order; ``forward``
sends one segment, ``verify`` a call of segments."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter
from operator import attrgetter
from typing import Any

import numpy as np

from app.targets.base import Target
from app.targets.channel import Breaker, Channel, Expected, Replica, Traffic
from app.targets.checks import Checks
from app.targets.failures import ReplicaFailure, WorkerError, error_body, error_message, status_failure
from app.targets.segments import (
    Segment,
    StageSession,
    as_verify,
    sampling,
    stage_request,
    unserved,
    verify_segment,
)
from core.errors import ProtocolError
from core.protocol import (
    BINARY_CONTENT_TYPE,
    InfoResponse,
    StageRequest,
    StageResponse,
    VerifyRequest,
    VerifyResponse,
    decode,
    encode,
)

log = logging.getLogger(__name__)

_HEADERS = {"content-type": BINARY_CONTENT_TYPE, "accept": BINARY_CONTENT_TYPE}
# what a replica shares with its stage
_STAND_IN = attrgetter("layer_range", "num_layers", "tokenizer_fingerprint", "backend")


class StageShort(Exception):
    """A stage answered 409, or the pipeline failed over since the session's last segment: ``restart`` it."""


class StageDown(WorkerError):
    """Stage ``stage`` (0-based) failed: ``fail_over`` may move it to a replica."""

    def __init__(self, worker: str, stage: int, message: str, status: int = 502) -> None:
        super().__init__(worker, message, status)
        self.stage = stage


class PipelineTarget(Target):
    """One weighted member of the federation whose model runs on stage workers, in order."""

    is_openai_logprobs = False

    def __init__(
        self,
        name: str,
        stages: list[list[str]],
        weight: float,
        channel: Channel,
        expected: Expected,
        threshold: int,
    ) -> None:
        self.name, self.weight, self.channel, self.expected = name, weight, channel, expected
        # per stage, first layers first: its replicas (the configured URL first), and the one in use
        self.members = [[Replica(url.rstrip("/"), Breaker(threshold)) for url in urls] for urls in stages]
        self.active = [0] * len(stages)
        self.chain = 0  # failovers so far: a session started on an earlier chain starts again
        self.sessions: dict[str, StageSession] = {}
        self.failures: Counter[str] = Counter()  # by kind
        self.failovers = 0  # stages moved to a replica
        self.restarts = 0  # sessions started again after a 409 or a failover
        self.checks = Checks()

    @property
    def replicas(self) -> list[Replica]:
        """The stages in use, first layers first."""
        return [members[i] for members, i in zip(self.members, self.active)]

    @property
    def url(self) -> str:
        return self.replicas[0].url

    @property
    def stages(self) -> int:
        return len(self.members)

    def scorable(self, sequence: list[int], draft: list[int]) -> int:
        return len(draft)

    async def check_all(self, timeout: float | None = None) -> dict[str, Any]:
        """Every stage replica's ``/v1/info`` at once (a stage's replica in use failing: one that answers),
        then the layout for ``/health/ready``; ``timeout``: one that has not answered by then counts as not
        answering this time (``Checks``)."""
        flat = [(i, j, r) for i, members in enumerate(self.members) for j, r in enumerate(members)]
        answers = await self.checks.wait(
            {f"{i}/{j}": functools.partial(self._info, r) for i, j, r in flat}, timeout
        )
        results = [answers[f"{i}/{j}"] for i, j, _ in flat]
        answered = {(i, j) for (i, j, _), result in zip(flat, results) if isinstance(result, InfoResponse)}
        for i, members in enumerate(self.members):
            spare = next((j for j in range(len(members)) if (i, j) in answered), None)
            if (i, self.active[i]) not in answered and spare is not None:
                self._switch(i, spare, f"it did not answer /v1/info: {members[self.active[i]].last_error}")
        replicas = [
            {"url": r.url, "stage": i + 1, "active": j == self.active[i], "ready": (i, j) in answered}
            | (
                {"layers": r.info.layer_range}
                if (i, j) in answered and r.info is not None
                else {"error": r.last_error}
            )
            for i, j, r in flat
        ]
        entry: dict[str, Any] = {
            "name": self.name,
            "url": self.url,
            "weight": self.weight,
            "ready": False,
            "replicas": replicas,
        }
        down = [r for r in replicas if r["active"] and not r["ready"]]
        if down:
            return entry | {
                "error": f"worker {self.name}: stage {down[0]['stage']} ({down[0]['url']}) not ready: "
                f"{down[0]['error']}"
            }
        infos = [r.info for r in self.replicas if r.info is not None]
        problem = layout_problem(self.replicas, infos, self.expected) or self._replica_problem(answered)
        if problem is not None:
            return entry | {"error": f"pipeline {self.name}: {problem}", "fatal": True}
        return entry | {
            "ready": True,
            "model": infos[-1].model_id,
            "max_context": min(i.max_context for i in infos),
            "stages": self.stages,
        }

    async def _info(self, replica: Replica) -> InfoResponse:
        """One stage replica's ``/v1/info``, recorded on it (its breaker, its last error)."""
        try:
            info = await self.channel.info(replica)
        except Exception as exc:
            replica.failed(exc)
            raise
        replica.info = info
        replica.breaker.record(ok=True)
        return info

    def _replica_problem(self, answered: set[tuple[int, int]]) -> str | None:
        """A replica that answers but could not stand in for its stage, or None."""
        for i, members in enumerate(self.members):
            used = members[self.active[i]].info
            for j, replica in enumerate(members):
                info = replica.info
                if (
                    (i, j) in answered
                    and info is not None
                    and used is not None
                    and _STAND_IN(info) != _STAND_IN(used)
                ):
                    return (
                        f"stage {i + 1}'s replica {replica.url} cannot stand in for "
                        f"{members[self.active[i]].url}: it serves layers "
                        f"{info.layer_range} of {info.num_layers} ({info.backend}), the stage "
                        f"{used.layer_range} of {used.num_layers} ({used.backend})"
                    )
        return None

    async def probe(self) -> None:
        """Stages with a replica whose breaker is open: checked again (the whole pipeline's layout)."""
        if any(r.breaker.is_open for members in self.members for r in members):
            await self.check_all()

    def fail_over(self, stage: int) -> bool:
        """Stage ``stage`` (0-based) failed: its replica is out until a probe passes; False when no checked
        replica can take over."""
        members = self.members[stage]
        failed = members[self.active[stage]]
        failed.breaker.failures = max(failed.breaker.failures, failed.breaker.threshold)
        spare = next((j for j, r in enumerate(members) if r.info is not None and not r.breaker.is_open), None)
        if spare is not None:
            self._switch(stage, spare, failed.last_error or "it failed")
        return spare is not None

    def _switch(self, stage: int, to: int, why: str) -> None:
        members = self.members[stage]
        log.warning(
            "pipeline %s: stage %d moves from %s to %s (%s)",
            self.name,
            stage + 1,
            members[self.active[stage]].url,
            members[to].url,
            why,
        )
        self.active[stage] = to
        self.chain += 1
        self.failovers += 1

    def session(self, session_id: str) -> StageSession:
        return self.sessions.setdefault(session_id, StageSession(session_id, chain=self.chain))

    async def forward(
        self, session_id: str, segment: Segment, sampling: dict[str, Any]
    ) -> tuple[StageResponse, Traffic]:
        """One segment through every stage; the last stage's answer (StageShort on a 409, else WorkerError
        naming the stage)."""
        stage = self.session(session_id)
        if stage.chain != self.chain:
            raise StageShort("a stage moved to a replica since the session's last segment")
        seq, stage.seq = stage.seq, stage.seq + 1  # taken now: segments in flight keep their order
        req = stage_request(stage, seq, segment, sampling, next=[r.url for r in self.replicas[1:]])
        traffic, first = Traffic(), self.replicas[0]
        body, _ = encode(req, self.expected.vocab_size)
        try:
            status, answer = await self.channel.exchange(first, "/v1/stage/forward", body, _HEADERS, traffic)
        except ReplicaFailure as exc:
            first.failed(exc)
            self.failures[exc.kind] += 1
            log.warning("pipeline %s: stage %s failed (%s): %s", self.name, first.url, exc.kind, exc)
            raise StageDown(
                self.name,
                0,
                f"stage 1 ({first.url}) failed: {exc}",
                503 if exc.kind in ("connect", "timeout") else 502,
            ) from None
        if status == 409:
            raise StageShort(error_message(answer))
        if status != 200:
            message = error_message(answer)
            where = "" if message.startswith("stage ") else f"stage 1 ({first.url}): "
            failure = status_failure(status, answer, "stage forward")
            self.failures[failure.kind] += 1
            if failure.kind == "http_5xx":
                down = self._failed_stage(answer)
                self.replicas[down].last_error = message
                raise StageDown(self.name, down, f"{where}{message}")
            raise WorkerError(self.name, f"{where}{message}", 400 if failure.kind == "rejected" else 502)
        try:
            resp = decode(StageResponse, answer, BINARY_CONTENT_TYPE)
            self._check(resp, req)
        except ProtocolError as exc:
            self.failures["garbage"] += 1
            raise WorkerError(self.name, f"the stages answered garbage: {exc}") from None
        first.breaker.record(ok=True)
        return resp, traffic

    def _failed_stage(self, answer: bytes) -> int:
        """Which stage a 5xx came from: the one a stage names in the error's ``param``, else the first."""
        body, urls = error_body(answer), [r.url for r in self.replicas]
        named = (
            (body.param or "").rstrip("/")
            if body is not None and body.code in ("stage_unreachable", "stage_failed")
            else None
        )
        return urls.index(named) if named in urls else 0

    def _check(self, resp: StageResponse, req: StageRequest) -> None:
        rows = len(req.tokens) - req.score_from
        if resp.probs is None or resp.tail_mass is None:
            if rows:
                raise ProtocolError("probs and tail_mass are missing")
            return
        probs = np.asarray(resp.probs)
        width = self.expected.vocab_size if req.k is None else req.k
        if probs.shape != (rows, width) or np.asarray(resp.tail_mass).shape != (rows,):
            raise ProtocolError(f"probs of shape {probs.shape}, expected ({rows}, {width})")
        if not np.all(np.isfinite(probs)) or probs.min(initial=0) < 0:
            raise ProtocolError("probs must be finite and ≥ 0")
        if req.k is not None and (resp.ids is None or np.asarray(resp.ids).shape != (rows, req.k)):
            raise ProtocolError("top-k answers need ids of the same shape as probs")

    def restart(self, session_id: str) -> StageSession:
        """The session under a new stage session id, holding nothing (the old one is freed)."""
        old = self.session(session_id)
        self.restarts += 1
        new = self.sessions[session_id] = StageSession(
            f"{session_id}~{old.restarts + 1}", restarts=old.restarts + 1, chain=self.chain
        )
        asyncio.get_running_loop().create_task(self._free(old.id))
        log.info("pipeline %s: session %s starts again as %s", self.name, session_id, new.id)
        return new

    async def verify(self, req: VerifyRequest, agreed: list[int]) -> tuple[VerifyResponse, Traffic]:
        """A verify call as one segment (``verify_segment``); once more from zero, under a new id, after a
        409."""
        if problem := unserved(req):
            raise WorkerError(self.name, f"a pipeline target does not serve {problem}", 400)
        shorts, from_zero = 0, False
        while shorts < 2:
            stage = self.session(req.session_id)
            segment, held_until = verify_segment(self.name, stage, req, agreed, from_zero)
            try:
                resp, traffic = await self.forward(req.session_id, segment, sampling(req))
            except StageShort as exc:
                log.info(
                    "pipeline %s lost session %s (%s): starting it again", self.name, req.session_id, exc
                )
                shorts += 1
            except StageDown as exc:
                if not self.fail_over(exc.stage):
                    raise
            else:
                stage = self.session(req.session_id)
                stage.rows, stage.draft_at = segment.prefix_len + len(segment.tokens), held_until
                return as_verify(resp, req, held_until), traffic
            self.restart(req.session_id)
            from_zero = True
        raise WorkerError(self.name, "the stages kept answering session_short after a start from zero")

    async def delete_session(self, session_id: str) -> None:
        """Free the session on every stage (best effort: they evict anyway)."""
        stage = self.sessions.pop(session_id, None)
        if stage is not None:
            await self._free(stage.id)

    async def _free(self, stage_id: str) -> None:
        await asyncio.gather(
            *(
                self.channel.free(r, stage_id)
                for members in self.members
                for r in members
                if not r.breaker.is_open
            )
        )


def layout_problem(replicas: list[Replica], infos: list[InfoResponse], expected: Expected) -> str | None:
    """What keeps these stages from being one pipeline of the draft's tokenizer (each a slice, in order, every
    layer once), or None."""
    for i, (replica, info) in enumerate(zip(replicas, infos)):
        where = f"stage {i + 1} ({replica.url})"
        if info.tokenizer_fingerprint != expected.fingerprint or info.vocab_size != expected.vocab_size:
            return (
                f"{where} serves another tokenizer/vocabulary than the draft ({info.model_id}, "
                f"V={info.vocab_size})"
            )
        if info.backend != "transformers":
            return (
                f"{where} runs {info.backend}: a pipeline stage needs --backend transformers "
                "(llama.cpp cannot run a slice of layers)"
            )
        if info.layer_range is None or info.num_layers is None:
            return (
                f"{where} is not a pipeline stage: it serves the whole model {info.model_id} (start "
                "it with --layers A:B)"
            )
    counts = {info.num_layers for info in infos}
    if len(counts) > 1:
        return (
            "the stages are slices of models of different depths "
            f"({sorted(c for c in counts if c is not None)} layers)"
        )
    total, at = infos[0].num_layers, 0
    for i, info in enumerate(infos):
        assert info.layer_range is not None
        first, end = info.layer_range
        if first > at:
            return (
                f"layers {at}:{first} are on no stage (gap before stage {i + 1}, which starts at "
                f"layer {first})"
            )
        if first < at:
            return (
                f"layers {first}:{min(at, end)} are on two stages (overlap: stage {i + 1} starts at "
                f"layer {first}, the stages before end at {at})"
            )
        at = end
    if at != total:
        return f"layers {at}:{total} are on no stage (the last stage ends at layer {at} of {total})"
    return None
