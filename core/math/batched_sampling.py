"""``T(p)`` for many rows at once, each with its own sampling parameters (issue 60: a worker step's rows
scored on the device, padded rows of every session together): the same law as
``core.math.sampling.apply_sampling`` row by row — temperature, then min-p, top-k, top-p, renormalised, T = 0
the untruncated softmax — as tensor ops with no branch on a value, so a step's scoring never waits for the
host."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.math.random import row_cumsum
from core.math.sampling import SamplingParams


@dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters as tensors ``[R]`` on the rows' device (``of`` builds them from
    SamplingParams)."""

    temperature: torch.Tensor  # f32; 0 = greedy
    top_k: torch.Tensor  # i64; 0 = off
    top_p: torch.Tensor  # f32; 1 = off
    min_p: torch.Tensor  # f32; 0 = off
    # what the host knows of them (no read-back): a truncation no row asks for is left out, which changes
    # nothing (each step is a no-op on a row that does not ask for it), and saves its sorts
    truncates: frozenset[str] = frozenset({"min_p", "top_k", "top_p"})
    # the largest top_k a sampled row asks for (its k-th largest found by a top-k, not a sort); 0 = not known
    largest_k: int = 0

    @classmethod
    def of(cls, params: list[SamplingParams], device: torch.device | str = "cpu") -> RowParams:
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            truncates=truncations(params),
            largest_k=largest_k(params),
        )


def largest_k(params: list[SamplingParams]) -> int:
    return max((p.top_k for p in params if not p.is_greedy), default=0)


def truncations(params: list[SamplingParams]) -> frozenset[str]:
    """The truncations some sampled row asks for."""
    sampled = [p for p in params if not p.is_greedy]
    asked = {
        "min_p": any(p.min_p > 0 for p in sampled),
        "top_k": any(p.top_k > 0 for p in sampled),
        "top_p": any(p.top_p < 1 for p in sampled),
    }
    return frozenset(name for name, on in asked.items() if on)


def apply_sampling_rows(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    # logits [R, V] -> [R, V] fp32, rows sum to 1
    """Each row's ``T(p)`` under its own parameters; a step's whole score in a fixed number of kernels."""
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy = (params.temperature == 0)[:, None]
    sampled = ~greedy
    scaled = (
        logits / torch.where(greedy[:, 0], torch.ones_like(params.temperature), params.temperature)[:, None]
    )
    if "min_p" in params.truncates:  # min-p: below min_p × the row's largest probability
        probs = torch.softmax(scaled, dim=-1)
        below = probs < params.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(below & (params.min_p > 0)[:, None] & sampled, float("-inf"))
    if "top_k" in params.truncates:
        # top-k: below the row's k-th largest (ties at it kept); k off where 0 or ≥ V
        on = (params.top_k > 0) & (params.top_k < vocab)
        most = params.largest_k if 0 < params.largest_k < vocab else vocab
        ordered = (
            torch.topk(scaled, most, dim=-1).values
            if most < vocab
            else torch.sort(scaled, dim=-1, descending=True).values
        )
        kth = ordered.gather(-1, (params.top_k.clamp(min=1, max=most) - 1)[:, None])
        scaled = scaled.masked_fill((scaled < kth) & (on[:, None] & sampled), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if "top_p" not in params.truncates:
        return probs
    # top-p: outside the smallest nucleus of mass ≥ top_p (the most likely token always stays)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    # a row's sums whatever rows share the step (a seeded call's)
    mass_before = row_cumsum(sorted_probs) - sorted_probs
    drop_sorted = mass_before >= params.top_p[:, None]
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    scaled = scaled.masked_fill(drop & (params.top_p < 1)[:, None] & sampled, float("-inf"))
    return torch.softmax(scaled, dim=-1)
