"""What one draft is asked for, and the rows q̂ it draws from (docs/design.md §3.1–3.2, §9)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.math.sampling import SamplingParams, apply_sampling, normalised, top_ids, truncated_supports
from core.math.tree import SparseRow, path_of
from core.transform import LogitsTransform

GREEDY_ROW = 32  # a greedy tree's row: q̂'s most likely tokens kept (≥ any top_k or width a tree takes, 16)


@dataclass(frozen=True)
class DraftRequest:
    """One draft of one session after ``sequence``: ``truncation`` = (draft_top_k, draft_top_p), the
    ``transformer`` as the workers apply it (docs/design.md §3.9), the ``drafter`` (§3.10); ``shared`` = False
    for a seeded request: no other sessions' outputs (the same seed's draws would test a draft they
    shaped)."""

    session_id: str
    sequence: list[int]
    params: SamplingParams
    seed: int
    choice: int
    truncation: tuple[int, float] = (0, 1.0)
    transformer: LogitsTransform | None = None
    drafter: str = "model"  # a name in app.drafting.drafters.DRAFTERS
    shared: bool = True

    @property
    def truncating(self) -> bool:
        """q̂ is sampled on a truncated support (a sampled request with draft truncation)."""
        return not self.params.is_greedy and self.truncation != (0, 1.0)

    @property
    def grammar(self) -> bool:
        """A grammar shapes the draft (its forced runs come free)."""
        return self.transformer is not None and self.transformer.matcher is not None

    def shaped(self, logits: torch.Tensor, path: list[int]) -> torch.Tensor:  # [V] -> [V]
        """The logits after ``sequence`` + ``path`` as the targets' are transformed."""
        return (
            logits
            if self.transformer is None
            else self.transformer.rows(logits[None], self.sequence, [path])[0]
        )

    def q(
        self,
        logits: torch.Tensor,
        paths: list[list[int]],  # [R, V]: the rows after ``sequence`` + each path
    ) -> list[SparseRow]:  # R × ([s] ascending ids, [s] float64)
        """q̂ as sampled at each row, on its support (each row's numbers as alone): truncated where the
        request truncates (the chain's, ``truncated_support``); greedy: its ``GREEDY_ROW`` most likely tokens
        (ties at the last all kept) at their probabilities in the whole row (a greedy test reads the tokens
        alone; children and scores are the whole row's); else the whole row."""
        if self.transformer is not None:
            logits = self.transformer.rows(logits, self.sequence, paths)
        q = apply_sampling(logits, self.params)
        if self.truncating:
            return truncated_supports(q, *self.truncation)
        if self.params.is_greedy and GREEDY_ROW < q.shape[1]:
            ids = top_ids(q, GREEDY_ROW)
            # normalised's very sums, row by row
            totals = torch.stack([row.double().sum(dim=-1, keepdim=True) for row in q]).clamp(min=1e-300)
            if len({len(i) for i in ids}) == 1:  # the rows' ids together (a tie at the last keeps more)
                kept = torch.stack(ids)
                return list(zip(kept, q.gather(1, kept).double() / totals))
            return [(i, row[i].double() / total) for row, i, total in zip(q, ids, totals)]
        out = []
        for row in q:
            row = normalised(row)  # row by row: a batched sum may add in another order
            out.append(
                (torch.arange(row.shape[0]), row)
                if float(row.amin()) > 0
                else (row.nonzero()[:, 0], row[row > 0])
            )
        return out


def delta(token: int, vocab_size: int) -> torch.Tensor:  # [V] float64
    """A point mass: the row of a deterministic token (a lookup's, a grammar's forced one)."""
    row = torch.zeros(vocab_size, dtype=torch.float64)
    row[token] = 1.0
    return row


def delta_support(token: int) -> SparseRow:
    """``delta`` on its support."""
    return torch.tensor([token]), torch.ones(1, dtype=torch.float64)


@dataclass
class DraftNodes:
    """The nodes drafted so far, parents before children; ``scores``: cumulative log q̂; ``q_at``: q̂ at each
    expanded node (−1 = the root) on its support; ``free``: the forced runs' nodes."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    q_at: dict[int, SparseRow] = field(default_factory=dict)
    free: set[int] = field(default_factory=set)
    # position -> draws taken there (a draw's key: position, lane)
    lanes: dict[int, int] = field(default_factory=dict)

    def add(self, parent: int, token: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.depths.append(self.depths[parent] + 1 if parent >= 0 else 1)
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        """The tokens from the root's child down to ``node``."""
        return [self.tokens[v] for v in path_of(node, self.parents)]
