"""Logits -> what a verify call returns (DESIGN §3.2, §3.3): ``T(p_n)``, compressed to top-k
when asked, with σ_n and e_n; or the worker's own sample z_n ~ T(p_n) (autoregressive).
The math is core's: the gateway reconstructs with the very functions used here for e_n."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from core.math.aggregation import reconstruct, tv_distance
from core.math.compression import compress_top_k
from core.math.random import Purpose, sample_index, uniform, uniforms
from core.math.speculative import count_accepted, verify_greedy
from core.math.sampling import SamplingParams, apply_sampling
from core.names import Mode, Reconstruction
from core.protocol import VerifyRequest, VerifyResponse


def sampling_params(req: VerifyRequest) -> SamplingParams:
    return SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p)


def score(
    logits: torch.Tensor,  # [γ+1, V] fp32
    req: VerifyRequest,
    held: int,
    model_ms: float,
) -> VerifyResponse:
    """The answer to ``req`` from the target's logits at its γ+1 positions."""
    params = sampling_params(req)
    probs = apply_sampling(logits, params)
    if req.mode == Mode.SPLIT.value:
        return _split(probs, req, held, model_ms)
    if req.mode == Mode.EXACT.value and not params.is_greedy:
        return _exact(probs, req, held, model_ms)
    samples = None
    if req.mode == Mode.AUTOREGRESSIVE.value and not params.is_greedy:
        position = req.prefix_len + len(req.tokens)  # absolute index of the token drawn
        u = uniform(req.seed, req.choice, position, Purpose.WORKER_SAMPLE, req.worker)
        samples = np.array([sample_index(probs[0], u)], dtype=np.int32)
        if not req.return_probs:
            return VerifyResponse(held=held, samples=samples, model_ms=model_ms)
    return _distributions(probs, req, held, model_ms, samples)


def _first_position(req: VerifyRequest) -> int:
    """Absolute index of the token decided at slot 0."""
    return req.prefix_len + len(req.tokens)


def _split(
    probs: torch.Tensor,  # [γ+1, V]
    req: VerifyRequest,
    held: int,
    model_ms: float,
) -> VerifyResponse:
    """DSSD's worker half: the accept test with its own stream; the bonus, or p at the rejection."""
    gamma, base = len(req.draft), _first_position(req)
    if req.temperature == 0:  # greedy: accept while x_j is the argmax, then emit the argmax
        verdict = verify_greedy(probs, req.draft.tolist())
        return VerifyResponse(held=held, num_accepted=verdict.num_accepted, bonus=verdict.token, model_ms=model_ms)
    draft = torch.from_numpy(req.draft.astype(np.int64))
    accept_u = uniforms(req.seed, req.choice, list(range(base, base + gamma)), Purpose.ACCEPT, req.worker)
    q_draft = torch.from_numpy(np.asarray(req.draft_probs, dtype=np.float64))
    accepted = count_accepted(probs[torch.arange(gamma), draft], q_draft, accept_u)
    if accepted == gamma:
        bonus = sample_index(probs[gamma], uniform(req.seed, req.choice, base + gamma, Purpose.BONUS, req.worker))
        return VerifyResponse(held=held, num_accepted=gamma, bonus=bonus, model_ms=model_ms)
    rejected = _distributions(probs[accepted : accepted + 1], req, held, model_ms, None)
    return replace(rejected, num_accepted=accepted)


def _exact(
    probs: torch.Tensor,  # [γ+1, V]
    req: VerifyRequest,
    held: int,
    model_ms: float,
) -> VerifyResponse:
    """p_n on each draft support S_j, the mass off it, one sample from off it; a bonus sample."""
    gamma, base = len(req.draft), _first_position(req)
    sizes = np.asarray(req.support_sizes, dtype=np.int64)
    supports = np.split(np.asarray(req.support_ids, dtype=np.int64), np.cumsum(sizes)[:-1]) if gamma else []
    on_support, complement, samples = [], [], []
    for j, support in enumerate(supports):
        ids = torch.from_numpy(support)
        outside = probs[j].double().index_fill(0, ids, 0.0)
        mass = float(outside.sum())  # summed directly, not 1 − the rest
        u = uniform(req.seed, req.choice, base + j, Purpose.WORKER_COMPLEMENT, req.worker)
        on_support.append(probs[j, ids])
        complement.append(mass)
        samples.append(sample_index(outside, u) if mass > 0 else -1)
    bonus = sample_index(probs[gamma], uniform(req.seed, req.choice, base + gamma, Purpose.WORKER_BONUS, req.worker))
    return VerifyResponse(
        held=held,
        support_probs=torch.cat(on_support).numpy() if on_support else np.zeros(0, np.float32),
        complement=np.asarray(complement, dtype=np.float32),
        complement_samples=np.asarray(samples, dtype=np.int32),
        bonus=bonus,
        model_ms=model_ms,
    )


def _distributions(
    probs: torch.Tensor,  # [γ+1, V]
    req: VerifyRequest,
    held: int,
    model_ms: float,
    samples: np.ndarray | None,
) -> VerifyResponse:
    zeros = np.zeros(probs.shape[0], dtype=np.float32)
    if req.k is None or req.k == probs.shape[-1]:
        return VerifyResponse(
            held=held, probs=probs.numpy(), tail_mass=zeros, recon_error=zeros,
            samples=samples, probs_dtype=req.probs_dtype, model_ms=model_ms,
        )
    top = compress_top_k(probs, req.k)
    method = Reconstruction(req.reconstruction)
    if method is Reconstruction.RENORMALIZE:
        error = top.tail_mass  # TV(p/ρ on S, p) = σ exactly
    else:
        rebuilt = reconstruct(top.ids, top.probs, probs.shape[-1], method, top.tail_mass)
        error = tv_distance(rebuilt, probs).float()
    return VerifyResponse(
        held=held, ids=top.ids.numpy(), probs=top.probs.numpy(), tail_mass=top.tail_mass.numpy(),
        recon_error=error.numpy(), samples=samples, probs_dtype=req.probs_dtype, model_ms=model_ms,
    )
