"""Draft shapes (docs/design.md §3.6, §3.7): ``TreeShape``, ``SegmentSchedule``; torch-free, as the config
reads them (a check takes a fraction of a second)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


class ChildRule(StrEnum):
    """How a node's children were chosen: it fixes the accept rule (module docstring)."""

    SAMPLED = "sampled"
    SAMPLED_DISTINCT = "sampled_distinct"
    FIXED = "fixed"


MAX_TREE_NODES = 63  # nodes of one tree at most (a worker scores them in llama.cpp decodes of ≤ 32)


@dataclass(frozen=True)
class TreeShape:
    """How the draft grows a tree (docs/design.md §3.6). Sampled rules: each node at depth d gets
    ``widths[d-1]`` children drawn from q̂. ``fixed`` (EAGLE-2): per depth the ``top_k`` best nodes get their
    ``top_k`` most likely children, down to ``depth``; the best ``nodes`` overall stay."""

    rule: ChildRule
    widths: tuple[int, ...] = ()
    nodes: int = 14
    depth: int = 6
    top_k: int = 4

    def __post_init__(self) -> None:
        if self.rule is ChildRule.FIXED:
            if (
                not 1 <= self.nodes <= MAX_TREE_NODES
                or not 1 <= self.depth <= 32
                or not 1 <= self.top_k <= 16
            ):
                raise ValueError(
                    f"a fixed tree needs nodes in [1, {MAX_TREE_NODES}], depth in [1, 32], top_k in [1, 16]"
                )
        else:
            if not self.widths or not all(1 <= k <= 16 for k in self.widths) or len(self.widths) > 32:
                raise ValueError("a sampled tree needs widths: 1 to 32 depths of 1 to 16 children each")
            if self.size > MAX_TREE_NODES:
                raise ValueError(
                    f"widths {list(self.widths)} make {self.size} nodes; a tree has at most {MAX_TREE_NODES}"
                )

    @property
    def size(self) -> int:
        """Nodes of a full tree of this shape."""
        if self.rule is ChildRule.FIXED:
            return self.nodes
        return sum(math.prod(self.widths[:depth]) for depth in range(1, len(self.widths) + 1))

    @property
    def max_depth(self) -> int:
        return self.depth if self.rule is ChildRule.FIXED else len(self.widths)

    @classmethod
    def default(cls, greedy: bool) -> TreeShape:
        """What pays on the built-in pair (research/tree-and-pipeline.md §3.4), 14 nodes each: EAGLE-2 at T =
        0, else a 2-way root, chains below."""
        if greedy:
            return cls(ChildRule.FIXED, nodes=14, depth=6, top_k=4)
        return cls(ChildRule.SAMPLED_DISTINCT, widths=(2, 1, 1, 1, 1, 1, 1))

    def cut(self, depth: int) -> TreeShape:
        """The same shape no deeper than ``depth`` (≥ 1): what room is left allows."""
        if self.rule is ChildRule.FIXED:
            return TreeShape(self.rule, nodes=self.nodes, depth=min(self.depth, depth), top_k=self.top_k)
        return TreeShape(self.rule, widths=self.widths[:depth])


@dataclass(frozen=True)
class SegmentSchedule:
    """Mode ``pipeline`` (FlowSpec, docs/design.md §3.7): each round's EAGLE-2 ``tree`` goes best node first
    in segments of ``segment`` nodes, ``in_flight`` at once (0 = one per stage); while the live tree runs
    short, ``expand`` grows its best live leaf (no deeper than ``tree.depth`` below the walk)."""

    # every draft level and node costs on CPU: small trees pay (docs/performance.md)
    tree: TreeShape = TreeShape(ChildRule.FIXED, nodes=10, depth=5, top_k=3)
    segment: int = 6
    in_flight: int = 2
    expand: bool = True

    def __post_init__(self) -> None:
        if self.tree.rule is not ChildRule.FIXED:
            raise ValueError(
                "a pipeline's tree has fixed children (EAGLE-2): its segments are verified as they come"
            )
        if not 1 <= self.segment <= MAX_TREE_NODES or not 0 <= self.in_flight <= 16:
            raise ValueError(
                f"a pipeline's segment takes 1 to {MAX_TREE_NODES} nodes, in_flight 0 (one per stage) to 16"
            )
