"""Token trees (docs/design.md §3.6), verified in one walk (``core.math.walk``). A chain is the tree whose
parents are [−1, 0, 1, …]: it verifies to the very numbers of the textbook chain verifier
(``tests.oracles.verify_sampled``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from core.math.shapes import ChildRule

# [s] long ids (ascending), [s] probs: one distribution's support
SparseRow = tuple[torch.Tensor, torch.Tensor]
# a node nothing was drawn at (a leaf, a lookup node)
NO_ROW: SparseRow = (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.float64))


@dataclass(frozen=True)
class TokenTree:
    """n draft nodes in topological order, with the draft's sparse q̂ at the root and at each node: what its
    children were drawn from."""

    tokens: torch.Tensor  # [n] long: the draft token at each node
    parents: torch.Tensor  # [n] long: each node's parent, −1 = the root; parents[i] < i
    # [n+1, s] long: the support of q̂ at the root (row 0) and at node i (row i+1); −1 pads
    q_ids: torch.Tensor
    # [n+1, s] fp32 (or the draft's own float64, kept bit for bit): q̂ on those ids (0 on pads)
    q_probs: torch.Tensor
    rule: ChildRule = ChildRule.SAMPLED
    # [n] bool: lookup children (drawn from δ, tested by the fixed rule), first among their siblings; None =
    # none
    deterministic: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        if self.tokens.dim() != 1 or self.parents.shape != (n,):
            raise ValueError(
                f"tokens and parents must be [n], got {tuple(self.tokens.shape)} and "
                f"{tuple(self.parents.shape)}"
            )
        if self.q_ids.dim() != 2 or self.q_ids.shape[0] != n + 1 or self.q_probs.shape != self.q_ids.shape:
            raise ValueError(
                f"q_ids and q_probs must be [n+1, s] = [{n + 1}, s], got "
                f"{tuple(self.q_ids.shape)} and {tuple(self.q_probs.shape)}"
            )
        if n and not bool(((self.parents >= -1) & (self.parents < torch.arange(n))).all()):
            raise ValueError("every parent must be −1 (the root) or an earlier node")
        if self.deterministic is not None:
            if self.deterministic.shape != (n,) or self.deterministic.dtype != torch.bool:
                raise ValueError(
                    f"deterministic must be [n] = [{n}] bool, got "
                    f"{tuple(self.deterministic.shape)} {self.deterministic.dtype}"
                )
            flags = self.deterministic.tolist()
            for children in self._children_of.values():
                marks = [flags[c] for c in children]
                if marks != sorted(marks, reverse=True):
                    raise ValueError("a node's deterministic children come before its drawn ones")

    @classmethod
    def chain(
        cls,
        tokens: list[int],  # [γ]
        # γ × ([V] dense, 0 off its support; or (ids, probs)): q̂_j each x_j was drawn from
        q: Sequence[torch.Tensor | SparseRow] | torch.Tensor,
    ) -> TokenTree:
        """The chain as a tree: node j's parent is j − 1, q̂_j row j (none at the last); rows all dense or all
        sparse."""
        gamma = len(tokens)
        rows = list(q[:gamma])
        ids, probs = (
            pad_rows(rows, extra=1) if rows and isinstance(rows[0], tuple) else sparse_rows(rows, extra=1)
        )  # type: ignore[arg-type]
        return cls(
            torch.tensor(tokens, dtype=torch.long), torch.arange(gamma) - 1, ids, probs, ChildRule.SAMPLED
        )

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def ids(self) -> list[int]:
        """The draft tokens, node by node (a chain's, in order)."""
        return [int(t) for t in self.tokens.tolist()]

    @cached_property
    def is_chain(self) -> bool:
        return self._parent_list == list(range(-1, len(self) - 1))

    @property
    def is_sampled_chain(self) -> bool:
        """A chain drawn from q̂ (or greedy), as the chain verifiers assume; fixed or lookup children need the
        walk's fixed rule (docs/design.md §3.6, §3.10)."""
        return (
            self.is_chain
            and self.rule is not ChildRule.FIXED
            and (self.deterministic is None or not bool(self.deterministic.any()))
        )

    @cached_property
    def _parent_list(self) -> list[int]:
        return [int(p) for p in self.parents.tolist()]

    @cached_property
    def _depth_list(self) -> list[int]:
        return depths_of(self._parent_list)

    @cached_property
    def _children_of(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for node, parent in enumerate(self._parent_list):
            out.setdefault(parent, []).append(node)
        return out

    def head(self, n: int) -> TokenTree:
        """A chain's first ``n`` nodes."""
        return self._cut(0, min(n, len(self)))

    def tail(self, k: int) -> TokenTree:
        """A chain without its first ``k`` nodes: node k becomes the root's child."""
        return self._cut(min(k, len(self)), len(self))

    def _cut(self, start: int, end: int) -> TokenTree:
        # a chain's nodes [start, end), node start the root's child
        assert self.is_chain, "only chains are cut"
        flags = None if self.deterministic is None else self.deterministic[start:end]
        rows = slice(start, end + 1)
        return TokenTree(
            self.tokens[start:end],
            self.parents[start:end] - start,
            self.q_ids[rows],
            self.q_probs[rows],
            self.rule,
            flags,
        )

    def support(self, node: int) -> tuple[torch.Tensor, torch.Tensor]:
        # [s] long ids (ascending), [s] probs: q̂ at ``node`` (−1 = root)
        keep = self.q_ids[node + 1] >= 0
        return self.q_ids[node + 1][keep], self.q_probs[node + 1][keep]

    def q_values(
        self,
    ) -> (
        torch.Tensor
    ):  # [n] in q_probs' dtype: q̂(x) of each node's token under its parent's q̂ (pads, −1, match no token)
        n = len(self)
        ids, probs = (
            (self.q_ids[:n], self.q_probs[:n])
            if self.is_chain
            else (self.q_ids[self.parents + 1], self.q_probs[self.parents + 1])
        )
        hits = ids == self.tokens[:, None]
        at = hits.to(torch.uint8).argmax(dim=1, keepdim=True)
        return torch.where(hits.any(dim=1), probs.gather(1, at)[:, 0], torch.zeros((), dtype=probs.dtype))

    def depths(self) -> torch.Tensor:
        # [n] long: 1 for the root's children; position = agreed length + depth − 1
        return torch.tensor(self._depth_list, dtype=torch.long)

    def children(self, node: int) -> list[int]:
        """The children of ``node`` (−1 = the root), in draft order."""
        return list(self._children_of.get(node, ()))

    def num_deterministic(self, node: int) -> int:
        """How many of ``node``'s children (its first ones) are deterministic (lookup) children."""
        flags = self.deterministic
        return 0 if flags is None else sum(1 for c in self._children_of.get(node, ()) if bool(flags[c]))

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node``."""
        return path_of(node, self._parent_list)

    def q_row(self, node: int, vocab_size: int) -> torch.Tensor:  # [V] float64: q̂ at ``node`` (−1 = root)
        ids, probs = self.support(node)
        return torch.zeros(vocab_size, dtype=torch.float64).index_put_(
            (ids,), probs.double(), accumulate=True
        )

    def q_rows(
        self, vocab_size: int
    ) -> torch.Tensor:  # [n, V] in q_probs' dtype: each node's q̂ (its parent's row)
        """Dense rows of the q̂ each node was drawn from (for the chain-only relaxed test)."""
        out = torch.zeros(len(self), vocab_size, dtype=self.q_probs.dtype)
        for i, parent in enumerate(self.parents.tolist()):
            ids, probs = self.support(parent)
            out[i, ids] = probs
        return out

    def max_depth(self) -> int:
        """Depth of the deepest node (a chain's length): the positions a walk may decide − 1."""
        return max(self._depth_list, default=0)

    def max_width(self) -> int:
        """The most children of one node (the lanes a walk may use)."""
        return max((len(c) for c in self._children_of.values()), default=0)


def path_of(node: int, parents: Sequence[int], stop: int = -1) -> list[int]:
    """The nodes from the root's child (from below ``stop``) down to ``node`` (−1 = the root: none), given
    each node's parent (−1 below the root)."""
    path = []
    while node != stop and node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def depths_of(parents: Sequence[int]) -> list[int]:
    """Each node's depth (1 below the root), parents listed before their children."""
    depths: list[int] = []
    for parent in parents:
        depths.append(depths[parent] + 1 if parent >= 0 else 1)
    return depths


def sparse_rows(
    rows: list[torch.Tensor],  # m × [V]: distributions, 0 off their supports
    extra: int = 0,  # empty rows (all pads) after them
) -> tuple[torch.Tensor, torch.Tensor]:
    # [m + extra, s] long ids (ascending, −1 pads), [m + extra, s] probs in the rows' dtype
    """Dense rows as ids + probabilities of their supports, padded to the widest (one pass over all rows: a
    full row costs a copy, not a search)."""
    if not rows:
        return torch.full((extra, 1), -1, dtype=torch.long), torch.zeros(extra, 1, dtype=torch.float32)
    dense = torch.stack(rows)
    dtype = dense.dtype if dense.is_floating_point() else torch.float32
    if bool(dense.min() > 0):  # every row has full support (one reduction, no mask)
        width = dense.shape[1]
        ids = torch.arange(width).repeat(len(rows) + extra, 1)
        ids[len(rows) :] = -1
        return ids, torch.cat([dense.to(dtype), dense.new_zeros(extra, width, dtype=dtype)])
    mask = dense != 0
    counts = mask.sum(dim=1)
    width = max(int(counts.max()), 1)
    row, col = mask.nonzero(as_tuple=True)  # by row, then ascending id
    slot = torch.arange(row.numel()) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    ids = torch.full((len(rows) + extra, width), -1, dtype=torch.long)
    probs = torch.zeros(len(rows) + extra, width, dtype=dtype)
    ids[row, slot] = col
    probs[row, slot] = dense[row, col].to(dtype)
    return ids, probs


def pad_rows(
    rows: list[SparseRow],  # m × (ids, probs): supports already sparse
    extra: int = 0,  # empty rows (all pads) after them
) -> tuple[torch.Tensor, torch.Tensor]:
    # [m + extra, s] long ids (−1 pads), [m + extra, s] probs in the rows' dtype
    """Sparse rows padded to the widest, as ``sparse_rows`` lays them out."""
    width = max([1, *(len(ids) for ids, _ in rows)])
    dtype = rows[0][1].dtype if rows else torch.float32
    ids = torch.full((len(rows) + extra, width), -1, dtype=torch.long)
    probs = torch.zeros(len(rows) + extra, width, dtype=dtype)
    for i, (row_ids, row_probs) in enumerate(rows):
        ids[i, : len(row_ids)] = row_ids
        probs[i, : len(row_ids)] = row_probs
    return ids, probs
