"""Logits -> the distributions a verify call returns (DESIGN §3.2, §3.3): ``T(p_n)``, then
compressed to top-k when asked."""

from __future__ import annotations

import numpy as np
import torch

from core.math.compression import compress_top_k
from core.math.sampling import SamplingParams, apply_sampling
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
    probs = apply_sampling(logits, sampling_params(req))
    if req.k is None or req.k == probs.shape[-1]:
        return VerifyResponse(
            held=held,
            probs=probs.numpy(),
            tail_mass=np.zeros(probs.shape[0], dtype=np.float32),
            probs_dtype=req.probs_dtype,
            model_ms=model_ms,
        )
    top = compress_top_k(probs, req.k)
    return VerifyResponse(
        held=held,
        ids=top.ids.numpy(),
        probs=top.probs.numpy(),
        tail_mass=top.tail_mass.numpy(),
        probs_dtype=req.probs_dtype,
        model_ms=model_ms,
    )
