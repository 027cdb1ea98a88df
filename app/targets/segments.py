"""A verify call as pipeline segments (DESIGN §3.7), and the last stage's answer as a verify
answer: the translation between what a target is asked (``VerifyRequest``) and what stages
speak (``StageRequest`` rows), with nothing of the transport in it (app/targets/pipeline.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from app.targets.base import WorkerError
from core.math.random import Purpose, sample_index, uniform
from core.names import Mode
from core.protocol import StageRequest, StageResponse, VerifyRequest, VerifyResponse


@dataclass
class StageSession:
    """What the stages know a gateway session by: its id there (a new one after each restart),
    the next message's ``seq``; for ``verify``, the rows they hold and where the last draft began."""

    id: str
    seq: int = 0
    restarts: int = 0
    rows: int = 0
    draft_at: int = 0
    chain: int = 0  # the pipeline's chain (its failovers) when the session started


@dataclass(frozen=True)
class Segment:
    """One ``/v1/stage/forward`` of a session, as the strategy builds it."""

    prefix_len: int  # rows the stages hold after ``keep``
    tokens: list[int]  # the new rows
    parents: list[int] | None  # their parent rows (absolute); None = a chain after the prefix
    keep: list[int] | None  # rows that survive first; None = all
    score_from: int  # the last stage answers new rows [score_from, len(tokens))


def stage_request(stage: StageSession, seq: int, segment: Segment, sampling: dict[str, Any], **more: Any) -> StageRequest:
    """The message that carries ``segment``: the transform (DESIGN §3.9) rides only on the
    one that starts the stage session (prefix_len 0); the last stage keeps it."""
    if segment.prefix_len and sampling.get("transform") is not None:
        sampling = {**sampling, "transform": None}
    return StageRequest(
        session_id=stage.id, seq=seq, prefix_len=segment.prefix_len, tokens=np.asarray(segment.tokens, dtype=np.int64),
        parents=None if segment.parents is None else np.asarray(segment.parents, dtype=np.int32),
        keep=None if segment.keep is None else np.asarray(segment.keep, dtype=np.int32),
        score_from=segment.score_from, **sampling, **more,
    )


def verify_segment(name: str, stage: StageSession, req: VerifyRequest, agreed: list[int], from_zero: bool) -> tuple[Segment, int]:
    """The segment that carries a verify call, and where its draft's rows start: the stages keep
    the agreed rows (a crop, or the previous tree's accepted path) and append tokens + draft —
    or, from zero, every agreed token again."""
    keep: list[int] | None = None
    prefix = req.prefix_len
    if not from_zero and req.path is not None:  # the previous tree's accepted nodes become agreed rows
        keep = [*range(stage.draft_at), *(stage.draft_at + int(n) for n in req.path)]
        from_zero = len(keep) != prefix or stage.rows == 0
    elif not from_zero:
        from_zero = stage.rows < prefix
        if not from_zero and stage.rows > prefix:
            keep = list(range(prefix))
    tokens = [int(t) for t in req.tokens]
    if from_zero:
        held_until = req.prefix_len + len(tokens)
        tokens, keep, prefix = [int(t) for t in agreed[:held_until]], ([] if stage.rows else None), 0
    if not tokens:
        raise WorkerError(name, "a pipeline call appends at least the last agreed token (its row gives the first distribution)", 400)
    base = prefix + len(tokens)  # where the draft's rows start
    draft = [int(t) for t in req.draft]
    parents: list[int] | None = None
    if req.parents is not None:
        chain = list(range(prefix - 1, base - 1))
        parents = [*chain, *((base - 1) if int(p) < 0 else base + int(p) for p in req.parents)]
    return Segment(prefix, [*tokens, *draft], parents, keep, len(tokens) - 1), base

def as_verify(resp: StageResponse, req: VerifyRequest, held_until: int) -> VerifyResponse:
    """The last stage's answer as the verify answer a whole worker gives (its own draw in
    ``autoregressive``, its logprobs)."""
    model_ms = float(np.asarray(resp.stage_ms).sum()) if resp.stage_ms is not None else 0.0
    probs = np.asarray(resp.probs)
    out = VerifyResponse(
        held=held_until + len(req.draft), probs=resp.probs, tail_mass=resp.tail_mass, ids=resp.ids, recon_error=resp.recon_error,
        probs_dtype=resp.probs_dtype, model_ms=model_ms,
    )
    extra: dict[str, Any] = {}
    if req.mode == Mode.AUTOREGRESSIVE.value and req.temperature > 0:  # the worker's own draw, as a whole worker makes it
        position = req.prefix_len + len(req.tokens)
        u = uniform(req.seed, req.choice, position, Purpose.WORKER_SAMPLE, req.worker)
        extra["samples"] = np.array([sample_index(torch.from_numpy(probs[0].astype(np.float64)), u)], dtype=np.int32)
        if not req.return_probs:
            extra.update(probs=None, tail_mass=None, recon_error=None)
    if req.logprobs is not None:
        extra.update(top_logprobs(probs, req.logprobs))
    return replace(out, **extra) if extra else out


def unserved(req: VerifyRequest) -> str | None:
    """What of a verify call a pipeline cannot do (its stages speak segments: T(p) rows only)."""
    if req.mode in (Mode.SPLIT.value, Mode.EXACT.value):
        return f"mode {req.mode} (use autoregressive, aggregate, tree with aggregate's payload, or pipeline)"
    if req.score_ids is not None or req.score_tokens:
        return "scoring given tokens (echo with logprobs)"
    if req.logprobs is not None and req.k is not None:
        return "logprobs with a top-k payload (use k: full)"
    return None


def sampling(req: VerifyRequest) -> dict[str, Any]:
    full = req.mode == Mode.AUTOREGRESSIVE.value and req.temperature > 0  # the sample is drawn here, from p
    return {
        "temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p, "k": None if full else req.k,
        "probs_dtype": req.probs_dtype, "reconstruction": req.reconstruction, "min_p": req.min_p, "transform": req.transform,
    }


def top_logprobs(probs: np.ndarray, n: int) -> dict[str, np.ndarray]:
    """top-n ids and log-probabilities per row of full rows (ties to the lowest id)."""
    order = np.argsort(-probs, axis=-1, kind="stable")[:, :n]
    values = np.take_along_axis(probs, order, axis=-1)
    return {"top_ids": order.astype(np.int64), "top_logprobs": np.log(np.clip(values, 1e-45, None)).astype(np.float32)}

