"""A step's scoring where its logits are (issue 60, item 2, in progress): every call's rows scored together as tensor ops
over the step's rows, each row with its own sampling parameters, every result packed into one buffer that crosses to the
host once. It answers what ``workers.scoring.score`` answers for the calls it ``handles`` — ``aggregate`` (top-k with the
renormalising reconstruction, or full rows) and ``autoregressive`` at any temperature, no transform, no logprobs asked —
and ``score`` (the reference) stays the path for the rest. Uniforms are the host's Philox numbers, as ``score`` draws
them (the request's seed, position, purpose), uploaded with the step. Nothing here reads a value back before the copy.
Not yet wired into the worker's step: tests/workers/test_device_scoring.py holds it to ``score``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from core.math.batched_sampling import RowParams, apply_sampling_rows
from core.math.random import Purpose, sample_rows, uniform
from core.math.sampling import SamplingParams
from core.names import Mode, Reconstruction
from core.protocol import VerifyRequest, VerifyResponse


def handles(req: VerifyRequest) -> bool:
    """Whether ``score_step`` answers ``req`` as ``score`` would (else ``score`` answers it)."""
    if req.mode not in (Mode.AGGREGATE.value, Mode.AUTOREGRESSIVE.value):
        return False
    if req.score_ids is not None or req.score_tokens or req.parents is not None or req.transform is not None:
        return False
    return req.k is None or req.reconstruction == Reconstruction.RENORMALIZE.value


@dataclass(frozen=True)
class _Part:
    """Where one call's results lie in the packed buffer."""

    rows: int
    k: int | None
    sample: bool
    probs: bool


def score_step(logits: torch.Tensor, reqs: list[VerifyRequest], helds: list[int], model_ms: float) -> list[VerifyResponse]:
    """``logits``: the step's kept rows ``[R, V]`` (fp32, any device), each call's γ + 1 rows in the order of ``reqs``."""
    sizes = [len(req.draft) + 1 for req in reqs]
    device, vocab = logits.device, logits.shape[-1]
    params = [SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, min_p=r.min_p) for r in reqs]
    rows = RowParams.of([p for p, n in zip(params, sizes) for _ in range(n)], device)
    probs = apply_sampling_rows(logits, rows)  # [R, V]
    ordered, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # ties: the lowest id first, as compress_top_k
    chunks: list[torch.Tensor] = []
    parts: list[_Part] = []
    start = 0
    firsts = []
    for req, n, p in zip(reqs, sizes, params):
        sample = req.mode == Mode.AUTOREGRESSIVE.value and not p.is_greedy
        send_probs = not sample or req.return_probs
        k = None if req.k is None or req.k == vocab else int(req.k)
        if send_probs and k is None:
            chunks.append(probs[start : start + n].double().reshape(-1))
        elif send_probs:
            kept = torch.zeros(n, vocab, dtype=torch.bool, device=device).scatter_(-1, order[start : start + n, :k], True)
            tail = probs[start : start + n].masked_fill(kept, 0).sum(dim=-1, dtype=torch.float64).float()
            chunks += [order[start : start + n, :k].double().reshape(-1), ordered[start : start + n, :k].double().reshape(-1), tail.double()]
        if sample:
            firsts.append(start)
        parts.append(_Part(n, k, sample, send_probs))
        start += n
    if firsts:  # row 0 of each sampling call, by the host's numbers
        u = torch.tensor(
            [uniform(r.seed, r.choice, r.prefix_len + len(r.tokens), Purpose.WORKER_SAMPLE, r.worker) for r, part in zip(reqs, parts) if part.sample],
            dtype=torch.float64, device=device,
        )
        chunks.append(sample_rows(probs[firsts], u).double())
    packed = torch.cat(chunks).cpu().numpy() if chunks else np.zeros(0)  # the step's one copy
    return _unpack(packed, parts, reqs, helds, vocab, model_ms)


def _unpack(packed: np.ndarray, parts: list[_Part], reqs: list[VerifyRequest], helds: list[int], vocab: int, model_ms: float) -> list[VerifyResponse]:
    at = 0
    out: list[dict[str, np.ndarray | None]] = []
    for part in parts:
        fields: dict[str, np.ndarray | None] = {"ids": None, "probs": None, "tail": None}
        if part.probs and part.k is None:
            fields["probs"] = packed[at : at + part.rows * vocab].astype(np.float32).reshape(part.rows, vocab)
            at += part.rows * vocab
        elif part.probs:
            size = part.rows * part.k  # type: ignore[operator]
            fields["ids"] = packed[at : at + size].astype(np.int64).reshape(part.rows, -1)
            fields["probs"] = packed[at + size : at + 2 * size].astype(np.float32).reshape(part.rows, -1)
            fields["tail"] = packed[at + 2 * size : at + 2 * size + part.rows].astype(np.float32)
            at += 2 * size + part.rows
        out.append(fields)
    samples = packed[at:].astype(np.int32)
    answers = []
    drawn = iter(samples)
    for part, fields, req, held in zip(parts, out, reqs, helds):
        sample = np.array([next(drawn)], dtype=np.int32) if part.sample else None
        if part.sample and not part.probs:
            answers.append(VerifyResponse(held=held, samples=sample, model_ms=model_ms))
            continue
        zeros = np.zeros(part.rows, dtype=np.float32)
        if part.k is None:
            answers.append(VerifyResponse(
                held=held, probs=fields["probs"], tail_mass=zeros, recon_error=zeros, samples=sample, probs_dtype=req.probs_dtype, model_ms=model_ms,
            ))
        else:
            answers.append(VerifyResponse(
                held=held, ids=fields["ids"], probs=fields["probs"], tail_mass=fields["tail"], recon_error=fields["tail"], samples=sample,
                probs_dtype=req.probs_dtype, model_ms=model_ms,
            ))
    return answers
