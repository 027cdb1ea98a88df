"""Logits -> what a verify call returns (DESIGN §3.2, §3.3): ``T(p_n)``, compressed to top-k
when asked, with σ_n and e_n; or the worker's own sample z_n ~ T(p_n) (autoregressive).
The math is core's: the gateway reconstructs with the very functions used here for e_n."""

from __future__ import annotations

import numpy as np
import torch

from core.math.aggregation import reconstruct, tv_distance
from core.math.compression import compress_top_k
from core.math.random import Purpose, sample_index, uniform
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
    samples = None
    if req.mode == Mode.AUTOREGRESSIVE.value and not params.is_greedy:
        position = req.prefix_len + len(req.tokens)  # absolute index of the token drawn
        u = uniform(req.seed, req.choice, position, Purpose.WORKER_SAMPLE, req.worker)
        samples = np.array([sample_index(probs[0], u)], dtype=np.int32)
        if not req.return_probs:
            return VerifyResponse(held=held, samples=samples, model_ms=model_ms)
    return _distributions(probs, req, held, model_ms, samples)


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
