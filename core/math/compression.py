"""Compressing a distribution to its top-k entries (docs/design.md §2: ``S``, ``ρ``, ``σ``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
    """Top-k of each row in O(V) (no full sort); ``σ`` is summed directly over the rest, not taken as ``1 −
    ρ``."""
    if not 0 < k <= probs.shape[-1]:
        raise ValueError(f"k must lie in [1, {probs.shape[-1]}], got {k}")
    kept, ids = top_k_entries(probs, k)  # [num_positions, V] mask, [num_positions, k] ascending ids
    values = probs.gather(-1, ids)
    values, order = torch.sort(values, dim=-1, descending=True, stable=True)  # ties keep id order
    tail = probs.masked_fill(kept, 0).sum(dim=-1, dtype=torch.float64).float()
    return TopK(ids=ids.gather(-1, order), probs=values.float(), tail_mass=tail)


def top_k_entries(
    probs: torch.Tensor,  # [num_positions, V]
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    # [num_positions, V] bool, exactly k True per row; [num_positions, k] their ids, ascending
    """The k largest entries of each row, ties at the threshold broken to the lowest id."""
    if k == 1 and probs.device.type == "cpu":
        # a greedy call's top-1: an argmax, ~4× cheaper than topk over the row
        rows = probs.numpy()
        best = rows.argmax(axis=-1)[:, None]
        if bool((np.count_nonzero(rows >= np.take_along_axis(rows, best, axis=-1), axis=-1) == 1).all()):
            # no tie at the top
            ids = torch.from_numpy(best.astype(np.int64))
            return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, ids, True), ids
    top = torch.topk(probs, k, dim=-1)
    threshold = top.values[:, -1:]
    if bool(((probs >= threshold).sum(dim=-1) == k).all()):  # no tie at any threshold: topk's are the ones
        ids = torch.sort(top.indices, dim=-1).values
        return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, ids, True), ids
    above = probs > threshold
    tied = probs == threshold
    room = k - above.sum(dim=-1, keepdim=True)
    kept = above | (tied & (torch.cumsum(tied, dim=-1) <= room))
    return kept, kept.nonzero()[:, 1].view(probs.shape[0], k)
