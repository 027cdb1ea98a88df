"""Lookup drafting at the gateway (docs/design.md §3.10): a proposal (q̂ = δ) from the session's context or
the outputs of ended sessions, how it joins a draft, and the acceptance it learns (``AcceptanceStats``)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from app.drafting.batcher import DraftSeconds
from app.drafting.request import DraftNodes, DraftRequest, delta_support
from core.lookup import NO_PROPOSAL, AcceptanceStats, LookupParams, PromptLookup, Proposal, SuffixIndex
from core.math.rerank import drafted_above
from core.math.shapes import TreeShape
from core.math.tree import NO_ROW, TokenTree, pad_rows
from core.transform import LogitsTransform

# a lookup token's acceptance, given the one before it was accepted, before any is measured
LOOKUP_PRIOR = 0.5
MODEL_PRIOR = 0.7  # a draft model token's (a chain's), likewise
# a sampled tree's node's acceptance per level of its path: first child, a later one (before measured)
SLOT_PRIOR = (0.7, 0.15)

Kind = tuple[object, ...]  # an ``AcceptanceStats`` key
Place = tuple[int, ...]  # a node's place in a sampled shape: its path's ranks among siblings
Plan = tuple[int, set[Place], dict[Place, Kind]]  # lookup tokens taken, places given up, each place's kind


@dataclass
class Branch:
    """A lookup proposal: its tokens, their kinds, each one's acceptance given the one before it, whether
    those were measured (not a prior), and a draft model token's kind and acceptance (a chain's yardstick)."""

    tokens: list[int]
    keys: list[Kind]
    rates: list[float]
    measured: bool
    model_key: Kind = ("model",)
    model_rate: float = MODEL_PRIOR


@dataclass
class Record:
    """What a draft's nodes were, for ``LookupDrafter.observe``: (node, kind) of its lookup nodes in run
    order (a chain's every token), and of a sampled tree's drafted nodes by their place in its shape."""

    lookup: list[tuple[int, Kind]] = field(default_factory=list)
    slots: list[tuple[int, int, Kind]] = field(default_factory=list)  # (node, its parent, kind)


class LookupDrafter:
    """Per-session context indexes, the suffix index of ended sessions' outputs, the measured acceptance."""

    def __init__(self, eos_ids: list[int]) -> None:
        self.eos_ids = set(eos_ids)
        self.params = LookupParams()
        self.suffixes = SuffixIndex(self.params)  # the outputs of ended sessions
        # measured: lookup tokens by place and match, tree nodes by place in their shape
        self.acceptance = AcceptanceStats()
        self.num_lookups = self.num_lookup_hits = self.num_lookup_tokens = 0  # since start (metrics)
        self._contexts: dict[str, PromptLookup] = {}  # session -> its context's n-grams
        self._records: dict[str, Record] = {}  # session -> what its last draft's nodes were (``observe``)

    def propose(
        self,
        session_id: str,
        sequence: list[int],
        count: int,
        transformer: LogitsTransform | None,
        shared: bool = True,
    ) -> Proposal:
        """Prompt lookup in the session's context, else the suffix index; cut after an EOS and before a token
        the grammar forbids (never accepted)."""
        if count <= 0:
            return NO_PROPOSAL
        index = self._contexts.setdefault(session_id, PromptLookup(self.params))
        index.sync(sequence)
        proposal: Proposal = index.propose(count)
        if not proposal.tokens and shared:
            proposal = self.suffixes.propose(sequence, count)
        tokens = proposal.tokens
        end = next((i + 1 for i, t in enumerate(tokens) if t in self.eos_ids), len(tokens))
        tokens = tokens[:end]
        if tokens and transformer is not None and transformer.masks_any:
            masks = transformer.masks(sequence, [tokens[:j] for j in range(len(tokens))])  # [len, V]
            tokens = tokens[: next((j for j, t in enumerate(tokens) if not bool(masks[j, t])), len(tokens))]
        self.num_lookups += 1
        self.num_lookup_hits += bool(tokens)
        self.num_lookup_tokens += len(tokens)
        return Proposal(tokens, proposal.match if tokens else 0)

    def chain(self, request: DraftRequest, count: int, timing: DraftSeconds | None) -> TokenTree:
        """The lookup's proposal alone: a chain of δ rows, no model step (its time is the draft's
        sampling)."""
        started = time.perf_counter()
        tokens = self.propose(
            request.session_id, request.sequence, count, request.transformer, request.shared
        ).tokens
        if timing is not None:
            timing["draft_sampling"] = timing.get("draft_sampling", 0.0) + time.perf_counter() - started
        return TokenTree.chain(tokens, [delta_support(t) for t in tokens])

    def branch(self, request: DraftRequest, count: int) -> Branch:
        """The lookup's proposal as a branch, each token's acceptance measured for its kind (a seeded request:
        the prior); a model token's likewise."""
        proposal = self.propose(
            request.session_id, request.sequence, count, request.transformer, request.shared
        )
        greedy, shared = request.params.is_greedy, request.shared
        keys: list[Kind] = [
            ("lookup", greedy, min(proposal.match, 4), j) for j in range(len(proposal.tokens))
        ]
        model = ("model", greedy)
        return Branch(
            proposal.tokens,
            keys,
            [self.acceptance.rate(key, LOOKUP_PRIOR, shared) for key in keys],
            shared,
            model,
            self.acceptance.rate(model, MODEL_PRIOR, shared),
        )

    def plan(self, shape: TreeShape, branch: Branch) -> Plan:
        """A sampled tree's share between the lookup's branch and the model's places (``displaced``)."""
        keys: dict[Place, Kind] = {
            place: ("slot", shape.rule.value, shape.widths, place) for place in shape_places(shape.widths)
        }
        values = {
            place: self.acceptance.rate(key, slot_prior(place), branch.measured)
            for place, key in keys.items()
        }
        count, gone = displaced(values, branch.rates)
        return count, gone, keys

    def keep(self, session_id: str, record: Record | None) -> None:
        if record is not None:
            self._records[session_id] = record

    def observe(self, session_id: str, path: list[int]) -> None:
        """The walk of the session's last draft accepted ``path``: only the candidates the walk tested count
        in ``acceptance`` (which nodes exist below depends on draws the next round redraws; counting them
        made the next draft depend on its own draws: TV 0.095 in a counter-example hunt)."""
        record = self._records.pop(session_id, None)
        if record is None:
            return
        accepted = set(path)
        for j, (node, key) in enumerate(record.lookup):
            if j and record.lookup[j - 1][0] not in accepted:
                break
            self.acceptance.observe(key, node in accepted)
        for node, parent, key in record.slots:
            if parent < 0 or parent in accepted:  # a node whose test the walk reached
                self.acceptance.observe(key, node in accepted)

    def forget(self, session_id: str, output: list[int] | None) -> None:
        """The session ended: its ``output`` (the tokens it generated) joins the suffix index."""
        self._contexts.pop(session_id, None)
        self._records.pop(session_id, None)
        if output:
            self.suffixes.add(output)


def with_branch(
    nodes: DraftNodes, shape: TreeShape, branch: Branch, plan: Plan, record: Record | None
) -> TokenTree:
    """A sampled tree with the lookup's branch first at the root, in the places the plan gives up."""
    count, gone, keys = plan
    tokens, parents, q_at, free = nodes.tokens, nodes.parents, nodes.q_at, nodes.free
    placed = places(parents, free)
    dropped: set[int] = set()
    for n in range(len(tokens)):
        if (n not in free and placed[n] in gone) or (parents[n] >= 0 and parents[n] in dropped):
            dropped.add(n)
    kept = [n for n in range(len(tokens)) if n not in dropped]
    index = {-1: -1, **{n: count + i for i, n in enumerate(kept)}}
    # a lookup node's row: no draft there
    rows = [q_at[-1], *([NO_ROW] * count), *(q_at.get(n, NO_ROW) for n in kept)]
    ids, probs = pad_rows(rows)
    tree = TokenTree(
        torch.tensor([*branch.tokens[:count], *(tokens[n] for n in kept)], dtype=torch.long),
        torch.tensor([*range(-1, count - 1), *(index[parents[n]] for n in kept)], dtype=torch.long),
        ids,
        probs,
        shape.rule,
        torch.tensor([True] * count + [False] * len(kept)),
    )
    if record is not None:
        record.lookup = list(zip(range(count), branch.keys))
        record.slots = [
            (index[n], index[parents[n]], keys[placed[n]])
            for n in kept
            if n not in free and placed[n] in keys
        ]
    return tree


def merged(branch: Branch, nodes: DraftNodes) -> list[int]:
    """The lookup's branch joined to a fixed tree's nodes (merged with a drafted sibling of the same token),
    scored by the log of its measured acceptance on top of its parent's; its nodes, in run order."""
    above, out = -1, []
    for token, rate in zip(branch.tokens, branch.rates):
        score = (nodes.scores[above] if above >= 0 else 0.0) + math.log(max(rate, 1e-9))
        match = next(
            (n for n in range(len(nodes.tokens)) if nodes.parents[n] == above and nodes.tokens[n] == token),
            None,
        )
        if match is None:
            match = nodes.add(above, token, score)
        else:
            nodes.scores[match] = max(nodes.scores[match], score)
        out.append(match)
        above = match
    return out


def places(parents: list[int], free: set[int]) -> dict[int, Place]:
    """Each drafted node's place in its sampled shape: its path's ranks among drafted siblings."""
    out: dict[int, Place] = {}
    ranks: dict[int, int] = {}  # drafted parent -> its drafted children so far
    for n in range(len(parents)):
        if n in free:
            continue
        above = drafted_above(n, parents, free)
        rank = ranks.get(above, 0)
        ranks[above] = rank + 1
        out[n] = (*(out[above] if above >= 0 else ()), rank)
    return out


def shape_places(widths: tuple[int, ...]) -> list[Place]:
    """Every place of a full sampled tree of ``widths``, depth by depth."""
    out: list[Place] = []
    level: list[Place] = [()]
    for k in widths:
        level = [(*place, rank) for place in level for rank in range(k)]
        out.extend(level)
    return out


def slot_prior(place: Place) -> float:
    return math.prod((SLOT_PRIOR[0] if rank == 0 else SLOT_PRIOR[1] for rank in place), start=1.0)


def displaced(values: dict[Place, float], rates: list[float]) -> tuple[int, set[Place]]:
    """How many of the lookup's tokens join a sampled tree and the places they take: the j-th token's
    expected acceptance against the least valuable removable place, while higher (never the draws)."""
    left, gone, reach = set(values), set[Place](), 1.0
    for rate in rates:
        reach *= rate
        removable = [
            place
            for place in left
            if not any(len(other) == len(place) + 1 and other[:-1] == place for other in left)
            and not any(
                other[:-1] == place[:-1] and other[-1] > place[-1]
                for other in left
                if len(other) == len(place)
            )
        ]
        if not removable:
            break
        low = min(removable, key=lambda place: (values[place], -len(place), [-r for r in place]))
        if values[low] >= reach:
            break
        left.discard(low)
        gone.add(low)
    return len(gone), gone
