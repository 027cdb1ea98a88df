"""Sampling parameters (docs/design.md §3.2): the one definition of ``T(p)`` every mode uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_TEMPERATURE = 1e-5  # vLLM's sampling epsilon: below it logits / T overflow; the API maps it to 0


@dataclass(frozen=True)
class SamplingParams:
    """How logits become the law a token is drawn from; T = 0 is greedy on untruncated ``softmax(logits)``
    (workers aggregate first, §3.2)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    # 0 = off: drop tokens below min_p × the row's largest probability (vLLM's; after temperature)
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE):
            raise ValueError(f"temperature must be 0 or ≥ {MIN_TEMPERATURE}, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be ≥ 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must lie in [0, 1), got {self.min_p}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def apply_sampling(
    logits: torch.Tensor,  # [num_positions, V]
    params: SamplingParams,
) -> torch.Tensor:  # [num_positions, V] fp32, rows sum to 1
    """``T(p)``: temperature, then min-p, top-k, top-p, renormalised (vLLM's order)."""
    logits = logits.float()
    if params.is_greedy:
        return torch.softmax(logits, dim=-1)
    if params.temperature != 1.0:  # x / 1 is x
        logits = logits / params.temperature
    if params.min_p > 0:
        logits = mask_min_p(logits, params.min_p)
    if 0 < params.top_k < logits.shape[-1]:
        logits = mask_top_k(logits, params.top_k)
    if params.top_p < 1:
        logits = mask_top_p(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


def normalised(
    probs: torch.Tensor,  # [..., V] ≥ 0: a distribution's rows as a model computed them (fp32)
) -> torch.Tensor:  # [..., V] float64, each row summing to 1 to float64 rounding
    """fp32 rows sum to 1 ± V·2⁻²⁴, and min(1, p/q) does not renormalise (an output off the row's law by as
    much): every row that feeds the accept test, the residual or a draw at T > 0 goes through here first."""
    p = probs.double()
    return p / p.sum(dim=-1, keepdim=True).clamp(min=1e-300)


def mask_min_p(
    logits: torch.Tensor,  # [num_positions, V]
    min_p: float,
) -> torch.Tensor:  # [num_positions, V], -inf below min_p × the row's largest probability
    """vLLM's min-p: keep the tokens whose probability is at least ``min_p`` times the largest."""
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))


def mask_top_k(
    logits: torch.Tensor,  # [num_positions, V]
    k: int,
) -> torch.Tensor:  # [num_positions, V], -inf outside the k largest
    """Keep the ``k`` largest logits of each row; ties at the threshold are all kept."""
    threshold = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < threshold, float("-inf"))


def mask_top_p(
    logits: torch.Tensor,  # [num_positions, V]
    top_p: float,
) -> torch.Tensor:  # [num_positions, V], -inf outside the nucleus
    """Keep the smallest set of largest-probability tokens whose mass reaches ``top_p``."""
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    drop_sorted[..., 0] = False  # the most likely token always stays (top_p may round to 0 in fp32)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def truncate(
    probs: torch.Tensor,  # [..., V]: a distribution to sparsify (the draft's, TSLT)
    top_k: int = 0,  # keep the k most likely (0 = off)
    top_p: float = 1.0,  # keep the smallest nucleus of mass ≥ top_p (1 = off)
) -> torch.Tensor:  # [..., V] renormalised; its support is what goes on the wire
    """Draft-side sparsification: the draft samples from this, so lossless stays lossless."""
    logits = torch.log(probs.double())
    if 0 < top_k < probs.shape[-1]:
        logits = mask_top_k(logits, top_k)
    if top_p < 1:
        logits = mask_top_p(logits, top_p)
    return torch.softmax(logits, dim=-1)


TOP_BLOCK = 128  # top_ids' block: a row's k best lie in its k blocks of largest maximum


def top_ids(
    probs: torch.Tensor,  # [R, V] ≥ 0
    k: int,  # 0 < k < V
) -> list[torch.Tensor]:
    # R × [s] long, ascending: every entry with mass at least the row's k-th largest (s > k only on ties
    # there)
    """The ids of each row's ``k`` largest entries (ties at the threshold all kept), as ``mask_top_k`` keeps
    them, without a top-k over whole rows: each row in blocks of ``TOP_BLOCK``; its k blocks of largest
    maximum hold its k-th largest value (were a block of the k largest entries left out, the k blocks taken
    would have k maxima at least as large); when no block left out reaches it, every entry kept is among them,
    else the whole row is compared (a tie at the threshold)."""
    rows, width = probs.shape
    blocks = width // TOP_BLOCK
    if blocks <= k or width % TOP_BLOCK:
        thresholds = torch.topk(probs, k, dim=-1).values[:, -1:]
        return [row.nonzero()[:, 0] for row in (probs >= thresholds) & (probs > 0)]
    cut = probs.view(rows, blocks, TOP_BLOCK)
    # per row: the k blocks of largest maximum, and the largest maximum left out
    best = torch.topk(cut.amax(dim=-1), k + 1, dim=-1)
    chosen = best.indices[:, :k]
    # the k-th largest and the next
    top = torch.topk(cut[torch.arange(rows)[:, None], chosen].reshape(rows, k * TOP_BLOCK), k + 1, dim=-1)
    ids = torch.sort(
        chosen.gather(1, top.indices[:, :k] // TOP_BLOCK) * TOP_BLOCK + top.indices[:, :k] % TOP_BLOCK, dim=-1
    ).values
    out = []
    for r, ((threshold, after), left) in enumerate(
        zip(top.values[:, k - 1 :].tolist(), best.values[:, k].tolist())
    ):
        if threshold > 0 and after < threshold and left < threshold:
            # no tie at the threshold, nothing left out reaches it
            out.append(ids[r])
        else:
            out.append(((probs[r] >= threshold) & (probs[r] > 0)).nonzero()[:, 0])
    return out


def truncated_supports(
    probs: torch.Tensor,  # [R, V]: distributions to sparsify (the draft's T(q), TSLT)
    top_k: int = 0,  # keep the k most likely (0 = off)
    top_p: float = 1.0,  # keep the smallest nucleus of mass ≥ top_p (1 = off)
) -> list[tuple[torch.Tensor, torch.Tensor]]:  # R × ([s] long ascending ids, [s] float64 probs summing to 1)
    """``truncated_support`` of every row, each row's very numbers (rows of one size go through together)."""
    ids = top_ids(probs, top_k) if 0 < top_k < probs.shape[-1] else [row.nonzero()[:, 0] for row in probs > 0]
    if len({len(i) for i in ids}) != 1:
        return [_renormalised(row[i], i, top_p) for row, i in zip(probs, ids)]
    together = torch.stack(ids)
    logits = torch.log(probs.gather(1, together).double())
    if top_p < 1:
        logits = mask_top_p(logits, top_p)
    out = torch.softmax(logits, dim=-1)
    if top_p < 1:
        return [(i[row > 0], row[row > 0]) for i, row in zip(together, out)]
    return list(zip(together, out))


def _renormalised(kept: torch.Tensor, ids: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.log(kept.double())
    if top_p < 1:
        logits = mask_top_p(logits[None], top_p)[0]
    out = torch.softmax(logits, dim=-1)
    if top_p < 1:
        inside = out > 0
        ids, out = ids[inside], out[inside]
    return ids, out


def truncated_support(
    probs: torch.Tensor,  # [V]: a distribution to sparsify (the draft's T(q), TSLT)
    top_k: int = 0,  # keep the k most likely (0 = off)
    top_p: float = 1.0,  # keep the smallest nucleus of mass ≥ top_p (1 = off)
) -> tuple[torch.Tensor, torch.Tensor]:  # [s] long ascending ids, [s] float64 probs summing to 1
    """``truncate`` on the support alone (docs/design.md §9): the same ids and ties, the probabilities
    renormalised over the kept entries (``truncate``'s up to the last bits), with no full-vocabulary log, sort
    or softmax at top_k."""
    return truncated_supports(probs[None], top_k, top_p)[0]
