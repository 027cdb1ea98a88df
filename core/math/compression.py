"""Compressing a distribution to its top-k entries (DESIGN §2: ``S``, ``ρ``, ``σ``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TopK:
    """The ``k`` largest entries per position and the mass left outside them."""

    ids: torch.Tensor  # [num_positions, k] int64, by falling probability, ties to the lowest id
    probs: torch.Tensor  # [num_positions, k] fp32
    tail_mass: torch.Tensor  # [num_positions] fp32: σ, summed over the entries not sent


def compress_top_k(
    probs: torch.Tensor,  # [num_positions, V]
    k: int,
) -> TopK:
    """Top-k of each row; ``σ`` is summed directly over the rest, not taken as ``1 − ρ``."""
    if not 0 < k <= probs.shape[-1]:
        raise ValueError(f"k must lie in [1, {probs.shape[-1]}], got {k}")
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    tail = sorted_probs[:, k:].sum(dim=-1, dtype=torch.float64).float()
    return TopK(ids=order[:, :k], probs=sorted_probs[:, :k].float(), tail_mass=tail)
