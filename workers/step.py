"""One worker step (docs/design.md §4, §9), on the model thread: calls of distinct sessions checked and
cropped one by one, **one** forward, each scored."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from core.errors import ContextOverflow, InvalidRequest, SessionShort
from core.math.tree import path_of
from core.modes import MODES
from core.protocol import StageRequest, VerifyRequest, VerifyResponse, check_verify_request
from core.runners import ModelRunner
from core.runners.base import ForwardItem
from core.runners.model_thread import ModelThread
from core.runners.step_upload import StepUpload
from core.transform import DeviceTransform
from workers.device_scoring import StepScoring, handles
from workers.scheduler import Piece, StepAnswer, Timing, Work
from workers.scoring import score, tree_item
from workers.sessions import SessionStore, Shaping, Transforms, shaped
from workers.settings import WorkerSettings
from workers.stage import StageSide

log = logging.getLogger(__name__)


@dataclass
class PendingStep:
    """A step launched — its host work done, its device work queued — and not yet answered
    (``Steps.finish``)."""

    answers: dict[int, StepAnswer]  # call index -> its answer, as each is known
    timings: list[Timing]
    sessions: set[str]  # the step's sessions: their next calls wait for its answers
    batch: int = 0
    # device-scored: index, call, rows, transform, held
    together: list[tuple[int, VerifyRequest, torch.Tensor, Shaping | None, int]] = field(default_factory=list)
    collect: Callable[[], list[VerifyResponse]] | None = None  # their results copied back and answered
    scored: float = 0.0
    # index, call, logits, echo rows, transform, held
    on_host: list[tuple[int, VerifyRequest, torch.Tensor, int, Shaping | None, int]] = field(
        default_factory=list
    )


class Steps:
    """The worker's step (what ``workers.scheduler`` runs): verify calls and stage segments, one forward, each
    answered; its parts, each handed what it needs: ``transforms`` (each session's), ``stage`` (a pipeline
    stage's side). ``scores_on_device``: a step's calls scored together where the logits are
    (workers.device_scoring), else each on the host."""

    def __init__(
        self,
        settings: WorkerSettings,
        runner: ModelRunner,
        sessions: SessionStore,
        counters: defaultdict[str, float],
        thread: ModelThread,
        scores_on_device: bool,
    ) -> None:
        self.settings, self.runner, self.sessions, self.counters, self.thread, self.scores_on_device = (
            settings,
            runner,
            sessions,
            counters,
            thread,
            scores_on_device,
        )
        self.transforms = Transforms(settings, runner, sessions)
        self.stage = StageSide(settings, runner, sessions, self.transforms, counters)
        # the step's one upload: the runner's (the static forward sends it with its inputs), else one of its
        # own for the scorer
        device = getattr(runner, "device", None) or torch.device("cpu")
        self.upload: StepUpload | None = getattr(runner, "upload", None) or (
            StepUpload(device) if scores_on_device else None
        )
        # an autoregressive answer's token decoded while the worker is idle (``look_ahead``): on a CPU, where
        # a decode is most of a round, the next call of its session finds it done; a pipeline stage or a
        # device scorer does not
        self.looks_ahead = (
            settings.decode_ahead
            and device.type == "cpu"
            and settings.layers is None
            and not scores_on_device
        )
        # session -> (rows held, the answer's token, seeded): to decode ahead
        self._wanted: dict[str, tuple[int, int, bool]] = {}
        # session -> (rows before it, its token, its logits [1, V], when its decode ran)
        self._ahead: dict[str, tuple[int, int, torch.Tensor, tuple[float, float]]] = {}

    def verify(self, req: VerifyRequest, timing: Timing | None = None) -> VerifyResponse:
        """``POST /v1/verify`` for one call alone; ``timing`` gets the model's and the scoring's ms."""
        answer = self.verify_batch([req], [timing or Timing()])[0]
        if isinstance(answer, Exception):
            raise answer
        assert isinstance(answer, VerifyResponse)  # a verify call's answer
        return answer

    def verify_batch(self, reqs: list[Work], timings: list[Timing]) -> list[StepAnswer]:
        """One scheduler step: per call its answer (``StepAnswer``); every ``model_ms`` is the step's forward
        (a call fed in pieces: theirs, summed). ``launch`` then ``finish``."""
        return self.finish(self.launch(reqs, timings))

    @property
    def overlaps(self) -> bool:
        """A step's device work runs while the host goes on (a GPU's stream): the scheduler may launch the
        next step before this one's answers come back (workers.scheduler)."""
        device = getattr(self.runner, "device", None)
        return (
            self.upload is not None and self.scores_on_device and device is not None and device.type == "cuda"
        )

    def launch(self, reqs: list[Work], timings: list[Timing]) -> PendingStep:
        """The step's host work and its device work queued: calls checked, the forward, the device's scoring.
        Where the runner has a step upload (the static forward), everything the host brings goes in it — cache
        moves, the forward's inputs, and for the calls scored on the device their transforms and the scorer's
        numbers — in one copy."""
        upload = self.upload
        if upload is not None:
            upload.begin()
        try:
            return self._launch(reqs, timings, upload)
        finally:
            if upload is not None:
                if upload.open:  # nothing forwarded: what was queued (a cache move) still lands
                    upload.send()
                upload.end()

    def _launch(self, reqs: list[Work], timings: list[Timing], upload: StepUpload | None) -> PendingStep:
        pending = PendingStep({}, timings, {r.session_id for r in reqs})
        if self._ahead:  # head starts of sessions freed or evicted since: their logits let go
            self._ahead = {s: kept for s, kept in self._ahead.items() if s in self.sessions}
        answers = pending.answers
        items, order = [], []
        # call index -> its place among the device-scored, its transform
        device: dict[int, tuple[int, Shaping | None, DeviceTransform | None]] = {}
        scored_calls: list[VerifyRequest] = []
        # calls whose decode was done ahead
        ahead: list[tuple[int, VerifyRequest, torch.Tensor, tuple[float, float], Shaping | None]] = []
        arrived = [timing.arrived for timing in timings]  # when each call reached the scheduler
        for i, req in enumerate(reqs):
            try:
                if isinstance(req, VerifyRequest) and (taken := self._taken_ahead(req)) is not None:
                    ahead.append((i, req, *taken, self._shaping(req)))
                    continue
                prepared = (
                    self.stage.prepare(req)
                    if isinstance(req, StageRequest)
                    else self._prepare_piece(req)
                    if isinstance(req, Piece)
                    else self._prepare(req)
                )
                item, rows, shaping = prepared
                if item is None:  # a piece the prompt cache held: nothing to decode
                    answers[i] = rows
                    continue
                call = req.req if isinstance(req, Piece) else req
                if isinstance(call, VerifyRequest) and call.seeded:
                    # its numbers must not depend on what shares the step
                    item = replace(item, alone=True)
                whole = not isinstance(req, Piece) or req.end is None
                if (
                    upload is not None
                    and self.scores_on_device
                    and whole
                    and isinstance(call, VerifyRequest)
                    and handles(call)
                ):
                    plan = (
                        shaping[0].device_plan(shaping[1], shaping[2], upload)
                        if shaping is not None
                        else None
                    )
                    device[i] = (len(scored_calls), shaping, plan)
                    scored_calls.append(call)
                items.append((item, rows, shaping))
                order.append(i)
            except Exception as exc:  # noqa: BLE001 - this call's answer
                answers[i] = exc
        scoring = StepScoring(scored_calls, upload) if upload is not None and scored_calls else None
        started = time.perf_counter()
        try:
            outputs = self.runner.forward_each([item for item, *_ in items]) if items else []
        finally:
            if upload is not None and upload.open:
                # a runner that sends nothing itself (transformers' modules): the scorer's numbers
                upload.send()
            # the calls decoded ahead too: none of this step's sessions is evicted
            answered = [*order, *(i for i, *_ in ahead)]
            for i in answered:
                self.sessions.touch(reqs[i].session_id)
            for i in answered:
                self.sessions.evict(keep=reqs[i].session_id)
        model_ms = (time.perf_counter() - started) * 1e3
        self.counters["model_seconds"] += model_ms / 1e3
        self.counters["steps"] += 1
        pending.batch = len(items)
        # scored on the device, all at once below
        together: list[tuple[int, VerifyRequest, torch.Tensor, Shaping | None, DeviceTransform | None]] = []
        for (_, scored_tokens, shaping), i, logits in zip(items, order, outputs):
            if isinstance(logits, Exception):
                answers[i] = logits
                continue
            req, scored = reqs[i], time.perf_counter()
            timings[i].model += model_ms
            if isinstance(req, Piece) and req.end is not None:
                answers[i] = scored_tokens  # a piece of a prompt: the tokens the session holds now
                continue
            try:
                call = req.req if isinstance(req, Piece) else req
                if isinstance(req, StageRequest):
                    answers[i] = self.stage.answer(req, logits.cpu(), model_ms)
                elif i in device:
                    assert isinstance(call, VerifyRequest)
                    _, shaping, plan = device[i]
                    together.append((i, call, logits[scored_tokens:], shaping, plan))
                    continue
                else:
                    # scored on the host once the device's answers are back: its copy then waits for nothing
                    assert isinstance(call, VerifyRequest)
                    pending.on_host.append(
                        (i, call, logits, scored_tokens, shaping, self.runner.length(call.session_id))
                    )
                    continue
            except Exception as exc:  # noqa: BLE001 - this call's answer
                answers[i] = exc
            if not isinstance(req, StageRequest):
                timings[i].score = (time.perf_counter() - scored) * 1e3
        if together:
            assert scoring is not None
            self._launch_scoring(pending, scoring, [device[i][0] for i, *_ in together], together)
        for i, call, logits, (began, ended), shaping in ahead:
            # no decode in this step: scored on the host with the others
            came = arrived[i]
            # its model time: the part of its decode it waited for
            since = began if came is None else max(began, came)
            timings[i].model = max(0.0, ended - since) * 1e3
            pending.on_host.append((i, call, logits, 0, shaping, self.runner.length(call.session_id)))
        return pending

    def _launch_scoring(
        self,
        pending: PendingStep,
        scoring: StepScoring,
        present: list[int],
        together: list[tuple[int, VerifyRequest, torch.Tensor, Shaping | None, DeviceTransform | None]],
    ) -> None:
        """The step's device-scored calls in one ``StepScoring`` (one copy back, in ``finish``); should it
        fail, each call alone on the host, so one bad call fails alone."""
        pending.together = [
            (i, call, raw, shaping, self.runner.length(call.session_id))
            for i, call, raw, shaping, _ in together
        ]
        pending.scored = time.perf_counter()
        try:
            rows = torch.cat(
                [plan.apply(raw) if plan is not None else raw for _, _, raw, _, plan in together]
            )
            pending.collect = scoring.launch(rows, present, [held for *_, held in pending.together], 0.0)
        except Exception:  # noqa: BLE001 - found in finish, call by call
            log.warning(
                "scoring a step of %d calls together failed; scoring them one by one on the host",
                len(together),
                exc_info=True,
            )

    def finish(self, pending: PendingStep) -> list[StepAnswer]:
        """The step's answers: the device's results copied back (the step's one copy), then the calls scored
        on the host."""
        answers, timings = pending.answers, pending.timings
        if pending.together:
            answered: list[Any] = []
            try:
                if pending.collect is None:
                    raise RuntimeError("the step's scoring was not launched")
                answered = pending.collect()
                self.counters["positions_scored_on_device"] += sum(
                    len(call.draft) + 1 for _, call, *_ in pending.together
                )
            except Exception:  # noqa: BLE001 - found below, call by call
                if pending.collect is not None:
                    log.warning(
                        "scoring a step of %d calls together failed; scoring them one by one on the host",
                        len(pending.together),
                        exc_info=True,
                    )
                answered = []
                for _, call, raw, shaping, held in pending.together:
                    try:
                        answered.append(score(shaped(raw.cpu(), shaping), call, held, 0.0))
                    except Exception as exc:  # noqa: BLE001 - this call's answer
                        answered.append(exc)
            score_ms = (time.perf_counter() - pending.scored) * 1e3
            for (i, call, *_), answer in zip(pending.together, answered):
                self.counters["positions_scored"] += len(call.draft) + 1
                if not isinstance(answer, Exception):
                    answer = replace(
                        answer,
                        model_ms=timings[i].model,
                        **({"batch_sessions": pending.batch} if pending.batch > 1 else {}),
                    )
                answers[i] = answer
                timings[i].score = score_ms  # every call waited for the step's scoring
        for i, call, logits, scored_tokens, shaping, held in pending.on_host:
            scored = time.perf_counter()
            try:
                answers[i] = self._verify_answer(
                    call, logits.cpu(), scored_tokens, shaping, timings[i].model, pending.batch, held
                )
            except Exception as exc:  # noqa: BLE001 - this call's answer
                answers[i] = exc
            timings[i].score = (time.perf_counter() - scored) * 1e3
        return [answers[i] for i in range(len(timings))]

    def _verify_answer(
        self,
        req: VerifyRequest,
        logits: torch.Tensor,
        scored_tokens: int,
        shaping: Shaping | None,
        model_ms: float,
        batch: int,
        held: int,
    ) -> VerifyResponse:
        """A call's answer from its logits: ``scored_tokens`` rows of its own tokens (echo), then its γ+1
        positions."""
        self.counters["positions_scored"] += len(req.draft) + 1
        rows = shaped(logits[scored_tokens:], shaping)
        resp = score(rows, req, held, model_ms, logits[:scored_tokens] if req.score_tokens else None)
        if self.looks_ahead and req.ahead and not MODES[req.mode].drafts and req.score_ids is None:
            token = (
                resp.samples[0]
                if resp.samples is not None
                else resp.ids[0, 0]
                if resp.ids is not None
                else None
            )
            if token is not None and held > 0 and int(token) not in self.runner.info.eos_ids:
                # EOS: the answer ends there
                self._wanted[req.session_id] = (held, int(token), req.seeded)
        return replace(resp, batch_sessions=batch) if batch > 1 else resp

    @property
    def wants_ahead(self) -> bool:
        """Whether an answer's token waits to be decoded ahead (read by the scheduler before it hops to the
        model thread)."""
        return bool(self._wanted)

    def look_ahead(self) -> int:
        """On the model thread, while no call waits: decode one session's last autoregressive token (its
        sample, or its greedy top-1) that the gateway said it takes as it is (``ahead``: a single worker),
        which its next call then carries unless the answer ended, and keep the logits (``_taken_ahead``); one
        at a time, so that a call arriving meanwhile waits for one decode at most (the scheduler looks again
        while its queue stays empty). A seeded call's alone, as its own decode would be. Sessions gone since
        are dropped; how many were decoded (0 or 1)."""
        while self._wanted:
            session_id = next(iter(self._wanted))
            held, token, seeded = self._wanted.pop(session_id)
            if (
                session_id not in self.sessions
                or self.runner.length(session_id) != held
                or held + 1 > self.stage.max_context
            ):
                continue
            try:
                item = self.runner.append_item(session_id, [token], 1)
            except ValueError:
                # its rows are no longer a chain (a tree call came between): nothing to decode ahead
                continue
            started = time.perf_counter()
            logits = self.runner.forward_each([replace(item, alone=True) if seeded else item])[0]
            finished = time.perf_counter()
            self.counters["model_seconds"] += finished - started
            self.counters["decoded_ahead"] += 1
            if isinstance(logits, Exception):
                self.runner.crop(session_id, held)
                return 0
            self._ahead[session_id] = (held, token, logits, (started, finished))
            return 1
        return 0

    def _taken_ahead(self, req: VerifyRequest) -> tuple[torch.Tensor, tuple[float, float]] | None:
        """The logits decoded ahead for this call (its session's rows then its one token, as its own decode
        would give them), the call checked and admitted as it would be; None when it carries anything else
        (its decode crops them)."""
        kept = self._ahead.pop(req.session_id, None)
        if kept is None:
            return None
        held, token, logits, ran = kept
        if (
            req.prefix_len != held
            or req.tokens.size != 1
            or int(req.tokens[0]) != token
            or req.draft.size
            or req.parents is not None
            or req.path is not None
            or req.score_tokens
            or req.score_ids is not None
            or self.runner.length(req.session_id) != held + 1
            or self.runner.tokens(req.session_id)[held] != token
        ):
            return None
        self._admit(req)
        self.counters["taken_ahead"] += 1
        return logits, ran

    def _prepare(self, req: VerifyRequest, fed: int = 0) -> tuple[ForwardItem, int, Shaping | None]:
        """Check a call and crop its session: its forward item, the logits rows scoring its own tokens (echo)
        before the γ+1, its transform. ``fed``: its first tokens are in the session already (pieces of it,
        checked then)."""
        if fed:
            self._check_fed(req, fed)
        else:
            self._admit(req)
        self.runner.crop(req.session_id, req.prefix_len + fed)
        shaping = self._shaping(req)  # a call fed in pieces starts its transform here, as it would whole
        # echo: the prompt's own rows too
        scored_tokens = max(len(req.tokens) - 1, 0) if req.score_tokens else 0
        if req.parents is not None:  # a tree: the root's and every node's row in one forward
            return tree_item(req, self.runner.tokens(req.session_id), fed), scored_tokens, shaping
        tokens = [*req.tokens.tolist()[fed:], *req.draft.tolist()]
        return (
            self.runner.append_item(req.session_id, tokens, len(req.draft) + 1 + scored_tokens),
            scored_tokens,
            shaping,
        )

    def _admit(self, req: VerifyRequest) -> None:
        """The call's checks: its limits, the prefix its session holds (or the tree path it keeps), a KV
        place."""
        self.check_limits(req)
        if req.path is not None:
            # v1.1: the previous tree's accepted path becomes agreed tokens (hash checked there)
            self.sessions.keep_path(req.session_id, req.prefix_len, req.prefix_hash, req.path.tolist())
        else:
            self.sessions.check_prefix(req.session_id, req.prefix_len, req.prefix_hash)
        self.sessions.admit(req.session_id, tree=req.parents is not None)

    def _prepare_piece(self, piece: Piece) -> tuple[ForwardItem | None, int, Shaping | None]:
        """A piece of a long call (workers.scheduler): the first checks the call and takes what a prompt cache
        holds of it (a new session: those rows are not fed again); each appends its tokens; the last is the
        call itself after them. For a piece, the second value is how many of the call's tokens the session
        holds after it (its answer)."""
        req, tokens = piece.req, piece.req.tokens.tolist()
        if piece.end is None:
            return self._prepare(req, piece.start)
        if piece.start:
            self._check_fed(req, piece.start)
            begin = piece.start
        else:
            self._admit(req)
            if req.parents is not None:
                # a tree's prompt: where its tree will be (llama.cpp: a slot, not a chain's stream)
                self.runner.expect_tree(req.session_id)
            # < len(tokens)
            cached = (
                self.runner.adopt(req.session_id, tokens)
                if req.prefix_len == 0 and req.parents is None
                else 0
            )
            if cached:
                # no decode: the pieces go on after what it holds, as a whole call's rows would
                return None, cached, None
            begin = 0
        end = min(begin + piece.end - piece.start, len(tokens) - 1)
        self.runner.crop(req.session_id, req.prefix_len + begin)
        return self.runner.append_item(req.session_id, tokens[begin:end], 1), end, None

    def _check_fed(self, req: VerifyRequest, fed: int) -> None:
        """The session still holds its prefix and the call's first ``fed`` tokens; else SessionShort (the
        gateway sends again)."""
        session_id = req.session_id
        held = (
            self.runner.tokens(session_id)[: self.runner.sequence_length(session_id)]
            if session_id in self.sessions
            else []
        )
        if held[req.prefix_len : req.prefix_len + fed] != req.tokens[:fed].tolist():
            raise SessionShort(
                session_id, min(len(held), req.prefix_len), "the session lost the first pieces of its prompt"
            )

    def _shaping(self, req: VerifyRequest) -> Shaping | None:
        """The session's transform (set by a call with prefix_len 0) with the agreed tokens and each scored
        row's path after them."""
        if req.prefix_len == 0:
            self.transforms.start_transform(req.session_id, req.transform)
        transformer = self.sessions.transforms.get(req.session_id)
        if transformer is None:
            return None
        agreed = [*self.runner.tokens(req.session_id)[: req.prefix_len], *req.tokens.tolist()]
        draft = req.draft.tolist()
        if req.parents is None:
            return transformer, agreed, [draft[:j] for j in range(len(draft) + 1)]
        parents = req.parents.tolist()
        return (
            transformer,
            agreed,
            [[], *([draft[n] for n in path_of(node, parents)] for node in range(len(parents)))],
        )

    def check_limits(self, req: VerifyRequest) -> None:
        check_verify_request(req, self.runner.info.vocab_size)
        if len(req.draft) > self.settings.max_draft:
            raise InvalidRequest(
                f"draft of {len(req.draft)} tokens exceeds max_draft {self.settings.max_draft}", param="draft"
            )
        if req.tokens.size == 0 and req.prefix_len == 0:
            raise InvalidRequest("a session starts with at least one token", param="tokens")
        if req.prefix_len + len(req.tokens) + len(req.draft) > self.stage.max_context:
            message = (
                f"prefix {req.prefix_len} + {len(req.tokens)} tokens + draft {len(req.draft)} "
                f"exceeds the context of {self.stage.max_context}"
            )
            raise ContextOverflow(message, param="draft")
