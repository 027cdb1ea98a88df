"""Lookup drafting at the gateway (DESIGN §3.10): the proposal, how it joins a draft, and the
acceptance it learns.

The session's context is indexed (``PromptLookup``) and the outputs of ended sessions go into
a bounded ``SuffixIndex``; a lookup proposal is a chain of deterministic tokens (q̂ = δ),
drafted with no model step (``lookup``) or joined to the model's draft (``model+lookup``): in
a chain, kept while the model agrees or it measures better; in a tree, a branch of
deterministic children weighed by measured acceptance (``AcceptanceStats``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from app.drafting.request import DraftRequest, delta_support
from core.lookup import NO_PROPOSAL, AcceptanceStats, LookupParams, PromptLookup, Proposal, SuffixIndex
from core.math.rerank import drafted_above
from core.math.shapes import TreeShape
from core.math.tree import TokenTree, sparse_rows
from core.transform import Transformer

LOOKUP_PRIOR = 0.5  # a lookup token's acceptance, given the one before it was accepted, before any is measured
MODEL_PRIOR = 0.7  # a draft model token's (a chain's), likewise
SLOT_PRIOR = (0.7, 0.15)  # a sampled tree's node's acceptance per level of its path: first child, a later one (before measured)

Kind = tuple[object, ...]  # an ``AcceptanceStats`` key
Place = tuple[int, ...]  # a node's place in a sampled shape: its path's ranks among siblings
Plan = tuple[int, set[Place], dict[Place, Kind]]  # lookup tokens taken, places given up, each place's kind


@dataclass
class Branch:
    """A lookup proposal: its tokens, their kinds, each one's acceptance given the one before
    it, whether those were measured (not a prior), and a draft model token's kind and
    acceptance (what a chain weighs a lookup token against)."""

    tokens: list[int]
    keys: list[Kind]
    rates: list[float]
    measured: bool
    model_key: Kind = ("model",)
    model_rate: float = MODEL_PRIOR


@dataclass
class Record:
    """What a draft's nodes were, for ``LookupDrafter.observe``: (node, kind) of its lookup nodes
    in run order — a chain's every token, lookup or model, in order: each is tested once the one
    before it was accepted — and of a sampled tree's drafted nodes by their place in its shape."""

    lookup: list[tuple[int, Kind]] = field(default_factory=list)
    slots: list[tuple[int, int, Kind]] = field(default_factory=list)  # (node, its parent, kind)


class LookupDrafter:
    """The lookup side of the draft: per-session context indexes, the suffix index of ended
    sessions' outputs, the measured acceptance, and what each session's last draft was."""

    def __init__(self, eos_ids: list[int]) -> None:
        self.eos_ids = set(eos_ids)
        self.params = LookupParams()
        self.suffixes = SuffixIndex(self.params)  # the outputs of ended sessions
        self.acceptance = AcceptanceStats()  # measured: lookup tokens by place and match, tree nodes by place in their shape
        self.num_lookups = self.num_lookup_hits = self.num_lookup_tokens = 0  # since start (metrics)
        self._contexts: dict[str, PromptLookup] = {}  # session -> its context's n-grams
        self._records: dict[str, Record] = {}  # session -> what its last draft's nodes were (``observe``)

    def propose(self, session_id: str, sequence: list[int], count: int, transformer: Transformer | None, shared: bool = True) -> Proposal:
        """The lookup's proposal after ``sequence``: prompt lookup in the session's context, else
        the suffix index of ended sessions' outputs; cut before an EOS's successors and before
        the first token a grammar does not allow (it could not be accepted)."""
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
            tokens = tokens[:next((j for j, t in enumerate(tokens) if not bool(masks[j, t])), len(tokens))]
        self.num_lookups += 1
        self.num_lookup_hits += bool(tokens)
        self.num_lookup_tokens += len(tokens)
        return Proposal(tokens, proposal.match if tokens else 0)

    def chain(self, request: DraftRequest, count: int, timing: dict[str, float] | None) -> TokenTree:
        """The lookup's proposal alone: a chain of δ rows, no model step (its time is the draft's sampling)."""
        started = time.perf_counter()
        tokens = self.propose(request.session_id, request.sequence, count, request.transformer, request.shared).tokens
        if timing is not None:
            timing["draft_sampling"] = timing.get("draft_sampling", 0.0) + time.perf_counter() - started
        return TokenTree.chain(tokens, [delta_support(t) for t in tokens])

    def branch(self, request: DraftRequest, count: int) -> Branch:
        """The lookup's proposal as a branch: each token's acceptance given the one before it, as
        measured for its place in the run, its match's length and greedy or not (the prior alone
        for a seeded request: ``shared`` = False); and a model token's, likewise (a chain's)."""
        proposal = self.propose(request.session_id, request.sequence, count, request.transformer, request.shared)
        greedy, shared = request.params.is_greedy, request.shared
        keys: list[Kind] = [("lookup", greedy, min(proposal.match, 4), j) for j in range(len(proposal.tokens))]
        model = ("model", greedy)
        return Branch(proposal.tokens, keys, [self.acceptance.rate(key, LOOKUP_PRIOR, shared) for key in keys], shared, model, self.acceptance.rate(model, MODEL_PRIOR, shared))

    def plan(self, shape: TreeShape, branch: Branch) -> Plan:
        """A sampled tree's share between the lookup's branch and the model's places
        (``displaced``), from the measured rates (priors for a seeded request)."""
        keys: dict[Place, Kind] = {place: ("slot", shape.rule.value, shape.widths, place) for place in shape_places(shape.widths)}
        values = {place: self.acceptance.rate(key, slot_prior(place), branch.measured) for place, key in keys.items()}
        count, gone = displaced(values, branch.rates)
        return count, gone, keys

    def keep(self, session_id: str, record: Record) -> None:
        self._records[session_id] = record

    def observe(self, session_id: str, path: list[int]) -> None:
        """The walk of the session's last draft accepted ``path``: its lookup tokens (each tested
        once the one before it was accepted) and its nodes' places count in ``acceptance`` —
        only the candidates the walk tested: which nodes exist below that depends on draws at
        positions past the round's end, which the next round draws again (keyed by position), and
        rates that moved with them would make the next round's draft depend on its own draws (a
        cold counter-example hunt measured TV 0.095 when every drafted node counted)."""
        record = self._records.pop(session_id, None)
        if record is None:
            return
        accepted = set(path)
        for j, (node, key) in enumerate(record.lookup):
            if j and record.lookup[j - 1][0] not in accepted:
                break
            self.acceptance.observe(key, node in accepted)
        for node, parent, key in record.slots:  # a node whose test the walk reached: one below the root or an accepted node
            if parent < 0 or parent in accepted:  # (whether the others exist depends on draws past the walk's end, which the next round redraws)
                self.acceptance.observe(key, node in accepted)

    def forget(self, session_id: str, output: list[int] | None) -> None:
        """The session ended: its ``output`` (the tokens it generated) joins the suffix index."""
        self._contexts.pop(session_id, None)
        self._records.pop(session_id, None)
        if output:
            self.suffixes.add(output)


def with_branch(
    tokens: list[int], parents: list[int], q_at: dict[int, torch.Tensor], free: set[int], shape: TreeShape, branch: Branch, plan: Plan,
    record: Record | None, vocab_size: int,
) -> TokenTree:
    """A sampled tree with the lookup's branch first at the root: its tokens displace the model's
    places the plan gives up (those nodes and what hangs below them go)."""
    count, gone, keys = plan
    placed = places(parents, free)
    dropped: set[int] = set()
    for n in range(len(tokens)):
        if (n not in free and placed[n] in gone) or (parents[n] >= 0 and parents[n] in dropped):
            dropped.add(n)
    kept = [n for n in range(len(tokens)) if n not in dropped]
    index = {-1: -1, **{n: count + i for i, n in enumerate(kept)}}
    empty = torch.zeros(vocab_size)
    rows = [q_at[-1], *([empty] * count), *(q_at.get(n, empty) for n in kept)]  # a lookup node's row: no draft there
    ids, probs = sparse_rows(rows)
    tree = TokenTree(
        torch.tensor([*branch.tokens[:count], *(tokens[n] for n in kept)], dtype=torch.long),
        torch.tensor([*range(-1, count - 1), *(index[parents[n]] for n in kept)], dtype=torch.long),
        ids, probs, shape.rule, torch.tensor([True] * count + [False] * len(kept)),
    )
    if record is not None:
        record.lookup = list(zip(range(count), branch.keys))
        record.slots = [(index[n], index[parents[n]], keys[placed[n]]) for n in kept if n not in free and placed[n] in keys]
    return tree


def merged(branch: Branch, tokens: list[int], parents: list[int], scores: list[float], depths: list[int]) -> list[int]:
    """The lookup's branch joined to a fixed tree's nodes: each token is the child of the one
    before it (the root's for the first), merged with a drafted sibling of the same token;
    scored by the log of its measured acceptance on top of its parent's (a node never outscores
    its parent: EAGLE-2's rerank keeps a tree). The branch's nodes, in run order."""
    above, out = -1, []
    for token, rate in zip(branch.tokens, branch.rates):
        score = (scores[above] if above >= 0 else 0.0) + math.log(max(rate, 1e-9))
        match = next((n for n in range(len(tokens)) if parents[n] == above and tokens[n] == token), None)
        if match is None:
            tokens.append(token)
            parents.append(above)
            scores.append(score)
            depths.append(depths[above] + 1 if above >= 0 else 1)
            match = len(tokens) - 1
        else:
            scores[match] = max(scores[match], score)
        out.append(match)
        above = match
    return out


def places(parents: list[int], free: set[int]) -> dict[int, Place]:
    """Each drafted node's place in its sampled shape: the ranks of its path among the drafted
    children of each node above (forced runs take no place)."""
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
    value = 1.0
    for rank in place:
        value *= SLOT_PRIOR[0] if rank == 0 else SLOT_PRIOR[1]
    return value


def displaced(values: dict[Place, float], rates: list[float]) -> tuple[int, set[Place]]:
    """How many of the lookup's tokens join a sampled tree and the shape's places they take:
    the j-th token's expected acceptance (the product of the rates up to it) against the least
    valuable place that can go — a leaf of what is left, the last of its siblings — while it is
    higher. The choice depends on the context and the measured rates, never on the draws."""
    left, gone, reach = set(values), set[Place](), 1.0
    for rate in rates:
        reach *= rate
        removable = [
            place for place in left
            if not any(len(other) == len(place) + 1 and other[:-1] == place for other in left)
            and not any(other[:-1] == place[:-1] and other[-1] > place[-1] for other in left if len(other) == len(place))
        ]
        if not removable:
            break
        low = min(removable, key=lambda place: (values[place], -len(place), [-r for r in place]))
        if values[low] >= reach:
            break
        left.discard(low)
        gone.add(low)
    return len(gone), gone
