"""A verify call as pipeline segments (docs/design.md §3.7) and the last stage's answer as a verify answer, no
transport."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from app.targets.failures import WorkerError
from core.math.random import Purpose, sample_index, uniform
from core.modes import MODES, SAMPLE, scoring_of
from core.protocol import StageRequest, StageResponse, VerifyRequest, VerifyResponse


@dataclass
class StageSession:
    """A gateway session at the stages: its id there (new after each restart), the next ``seq``, the rows
    held."""

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


def stage_request(
    stage: StageSession, seq: int, segment: Segment, sampling: dict[str, Any], **more: Any
) -> StageRequest:
    """The message that carries ``segment``; the transform rides only on the one that starts the stage
    session."""
    if segment.prefix_len and sampling.get("transform") is not None:
        sampling = {**sampling, "transform": None}
    return StageRequest(
        session_id=stage.id,
        seq=seq,
        prefix_len=segment.prefix_len,
        tokens=np.asarray(segment.tokens, dtype=np.int64),
        parents=None if segment.parents is None else np.asarray(segment.parents, dtype=np.int32),
        keep=None if segment.keep is None else np.asarray(segment.keep, dtype=np.int32),
        score_from=segment.score_from,
        **sampling,
        **more,
    )


def verify_segment(
    name: str, stage: StageSession, req: VerifyRequest, agreed: list[int], from_zero: bool
) -> tuple[Segment, int]:
    """The segment that carries a verify call (keep the agreed rows, append tokens + draft; or every token,
    from zero), and where its draft's rows start."""
    keep: list[int] | None = None
    prefix = req.prefix_len
    if not from_zero and req.path is not None:  # the previous tree's accepted nodes become agreed rows
        keep = [*range(stage.draft_at), *(stage.draft_at + int(n) for n in req.path)]
        from_zero = len(keep) != prefix or stage.rows == 0
    elif not from_zero:
        from_zero = stage.rows < prefix
        if not from_zero and stage.rows > prefix:
            keep = list(range(prefix))
    tokens = req.tokens.tolist()
    if from_zero:
        held_until = req.prefix_len + len(tokens)
        tokens, keep, prefix = [int(t) for t in agreed[:held_until]], ([] if stage.rows else None), 0
    if not tokens:
        raise WorkerError(
            name,
            "a pipeline call appends at least the last agreed token (its row gives the first distribution)",
            400,
        )
    base = prefix + len(tokens)  # where the draft's rows start
    parents = (
        None
        if req.parents is None
        else [*range(prefix - 1, base - 1), *(base - 1 if p < 0 else base + p for p in req.parents.tolist())]
    )
    return Segment(prefix, [*tokens, *req.draft.tolist()], parents, keep, len(tokens) - 1), base


def as_verify(resp: StageResponse, req: VerifyRequest, held_until: int) -> VerifyResponse:
    """The last stage's answer as the verify answer a whole worker gives (its draw in ``autoregressive``)."""
    out = VerifyResponse(
        held=held_until + len(req.draft),
        probs=resp.probs,
        tail_mass=resp.tail_mass,
        ids=resp.ids,
        recon_error=resp.recon_error,
        probs_dtype=resp.probs_dtype,
        model_ms=float(np.asarray(resp.stage_ms).sum()) if resp.stage_ms is not None else 0.0,
    )
    if scoring_of(req.mode, req.temperature > 0) != SAMPLE:
        return out
    # the worker's own draw, as a whole worker makes it
    u = uniform(req.seed, req.choice, req.prefix_len + len(req.tokens), Purpose.WORKER_SAMPLE, req.worker)
    samples = np.array(
        [sample_index(torch.from_numpy(np.asarray(resp.probs)[0].astype(np.float64)), u)], dtype=np.int32
    )
    return (
        replace(out, samples=samples)
        if req.return_probs
        else replace(out, samples=samples, probs=None, tail_mass=None, recon_error=None)
    )


def unserved(req: VerifyRequest) -> str | None:
    """What of a verify call a pipeline cannot do (its stages speak segments: T(p) rows only)."""
    if not MODES[req.mode].pipelines:
        return f"mode {req.mode} (use autoregressive, aggregate, tree with aggregate's payload, or pipeline)"
    if req.score_ids is not None or req.score_tokens:
        return "scoring given tokens (echo with logprobs)"
    if req.logprobs is not None:  # only split's, exact's and echo's calls ask the workers for them
        return "the workers' top logprobs"
    return None


def sampling(req: VerifyRequest) -> dict[str, Any]:
    full = scoring_of(req.mode, req.temperature > 0) == SAMPLE  # the sample is drawn here, from p
    return {
        "temperature": req.temperature,
        "top_k": req.top_k,
        "top_p": req.top_p,
        "k": None if full else req.k,
        "probs_dtype": req.probs_dtype,
        "reconstruction": req.reconstruction,
        "min_p": req.min_p,
        "transform": req.transform,
    }
