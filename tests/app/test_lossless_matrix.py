"""The lossless matrix: every configuration the API accepts, generated from the code's own
registries, each checked by the exact law of its output through the real engine.

Cells come from ``core.modes`` (the served modes, the fields each takes, the payloads each may
answer with), ``ChildRule``, ``Reconstruction`` and the tree payloads: mode × payload × child
rule × shape (the degenerate ones included: one node, top-1, widths ⟨1⟩ and ⟨1,1⟩, depth 1,
EAGLE-2 trees that prune to chains) × workers (one; two with unequal weights) × sampling
(T = 0, T = 1, with top-k, with top-p) × DSD overlap; then each further option a mode takes
(draft truncation, reconstruction, relaxation, ``min_tokens``) crossed with every mode,
payload, worker set and sampling. A field, mode, payload or rule the generator does not know
fails ``test_the_matrix_covers_every_registry``, so a new one cannot go untested.

Each cell runs the real DraftModel, engine, strategy and worker scoring over Markov fakes
(V = 4, EOS among the tokens) with every random draw enumerated (``tests.draws``): the law
of the first round's tokens (two rounds with overlap, the first tree's walk in a pipeline) is
exact, completed by the target's own conditionals after it — what the next rounds emit if they
are lossless, by induction. A cell that the response calls lossless (``core.modes.guarantee``,
the table the usage block's ``lossless`` reads) must give the target's law to 1e-9; a lossy
one must report a bound at the first position no smaller than the exact distance there.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import time
from collections.abc import Iterator
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any, get_args

import pytest
import torch

from app.drafting.drafters import DRAFTERS
from app.engine import Engine, GenerationRequest, RoundResult, SpecOptions
from app.engine import loop as loop_module
from app.engine import round as round_module
from app.engine.round import Round
from app.engine.strategies import STRATEGIES, RoundStrategy
from app.engine.strategies import pipeline as pipeline_strategy
from core.config import TreeParams
from core.grammar import GrammarKind, GrammarSpec
from core.lookup import AcceptanceStats, LookupParams, SuffixIndex
from core.math import walk as tree_math
from core.math.relaxed import Relaxation
from core.math.sampling import SamplingParams, apply_sampling, normalised
from core.math.shapes import ChildRule, SegmentSchedule, TreeShape
from core.math.tree import TokenTree
from core.modes import GUARANTEES, MODES, Guarantee, Payload, guarantee
from core.names import Mode, Reconstruction
from core.transform import TransformSpec
from tests.app.fakes import (
    MarkovRunner,
    TableMatcher,
    make_engine,
    pipeline_engine,
    random_table,
    split_pipeline,
    with_table_grammar,
)
from tests.app.helpers import seed_pool
from tests.draws import ExactDraws
from tests.draws import prefix_distance as draws_prefix_distance

V = 4
EOS = 3
PROMPT = [1, 0]  # the draft's top-1 after 0 is 0, then 0: fixed chains of two rows, forks at three nodes
SEED = 11
MAX_TOKENS = 16  # never the limit of a checked round
TOLERANCE = 1e-9


SAMPLINGS = {
    "T=0": SamplingParams(temperature=0.0),
    "T=1": SamplingParams(temperature=1.0),
    "T=1 top-k 2": SamplingParams(temperature=1.0, top_k=2),
    "T=0.8 top-p 0.8": SamplingParams(temperature=0.8, top_p=0.8),
}


def _table(seed: int) -> torch.Tensor:
    table = random_table(V, seed)
    table[:, EOS] -= 1.0  # EOS now and then
    return table


DRAFT = MarkovRunner(_table(500), eos_ids=[EOS], name="draft")
TARGETS = [MarkovRunner(_table(600 + i), eos_ids=[EOS], name=f"t{i}") for i in range(2)]
WORKER_SETS = {"1 worker": [1.0], "2 workers 0.7/0.3": [0.7, 0.3]}
CHAIN_SHAPES = {"γ=1": 1, "γ=2": 2}
TREE_SHAPES: dict[ChildRule, dict[str, dict[str, Any]]] = {  # TreeParams as a request gives them
    ChildRule.SAMPLED: {
        "⟨1⟩": {"widths": [1]},
        "⟨1,1⟩": {"widths": [1, 1]},
        "⟨2⟩": {"widths": [2]},
        "⟨2,1⟩": {"widths": [2, 1]},
    },
    ChildRule.SAMPLED_DISTINCT: {
        "⟨1⟩": {"widths": [1]},
        "⟨1,1⟩": {"widths": [1, 1]},
        "⟨2⟩": {"widths": [2]},
        "⟨2,1⟩": {"widths": [2, 1]},
    },
    ChildRule.FIXED: {
        "nodes 1": {"nodes": 1, "depth": 1, "top_k": 1},
        "top-1 chain of 2": {"nodes": 2, "depth": 2, "top_k": 1},
        "nodes 2 depth 2 top-2 (prunes to a chain)": {"nodes": 2, "depth": 2, "top_k": 2},
        "nodes 3 depth 2 top-2": {"nodes": 3, "depth": 2, "top_k": 2},
    },
}
PIPELINE_SHAPES = {
    "nodes 1, segments of 1": SegmentSchedule(
        TreeShape(ChildRule.FIXED, nodes=1, depth=1, top_k=1), segment=1, in_flight=1, expand=False
    ),
    "top-1 chain of 2, segments of 1": SegmentSchedule(
        TreeShape(ChildRule.FIXED, nodes=2, depth=2, top_k=1), segment=1, in_flight=2, expand=False
    ),
    "nodes 3 depth 2 top-2, segments of 2, expanding": SegmentSchedule(
        TreeShape(ChildRule.FIXED, nodes=3, depth=2, top_k=2), segment=2, in_flight=2
    ),
}
TREE_PAYLOADS = {
    Payload.FULL: ("aggregate", None),
    Payload.TOP_K: ("aggregate", 2),
    Payload.SPARSE: ("exact", None),
}
PROFILED = ("T=0", "T=1 top-k 2")  # the samplings ``profile`` (timing on) is crossed with
TOP_K = 2  # k of the top-k payload: two of the four ids left out
MIN_P = 0.3  # with min_tokens: EOS leaves before min-p takes its share of the top (issue 46)
# t0's top token after 1 is EOS (0.68): min-p's threshold there depends on whether EOS went first
EOS_TOP_PROMPT = (0, 1)
DRAFT_TOP_K = 2  # exact's truncation: two ids off every draft support (the complement sample is a real draw)

# Transforms (docs/design.md §3.9), each crossed with every mode, payload,
# worker set and sampling; the grammar is ``TableMatcher`` (it forces the first token, and 0 after 1).
_GRAMMAR = GrammarSpec(GrammarKind.REGEX, "the table grammar")
TRANSFORMS = {
    "logit_bias": TransformSpec(logit_bias=((0, -1.5), (2, 2.0)), prompt_len=len(PROMPT)),
    "presence + frequency": TransformSpec(
        presence_penalty=1.2, frequency_penalty=0.7, prompt_len=len(PROMPT)
    ),
    "repetition": TransformSpec(repetition_penalty=1.8, prompt_len=len(PROMPT)),
    "grammar": TransformSpec(grammar=_GRAMMAR, prompt_len=len(PROMPT)),
    "all": TransformSpec(
        logit_bias=((2, 0.5),),
        presence_penalty=0.6,
        frequency_penalty=0.9,
        repetition_penalty=1.3,
        grammar=_GRAMMAR,
        prompt_len=len(PROMPT),
    ),
}

# What the generator does with each field of ``speculative`` (core.modes): a field it does not
# know fails test_the_matrix_covers_every_registry.
PRIMARY_FIELDS = {"mode", "k", "tree", "num_draft_tokens", "overlap", "pipeline"}  # in the full product
# each value crossed with mode × payload × workers × sampling
SECONDARY_FIELDS = {"draft_top_k", "draft_top_p", "reconstruction", "relaxation", "profile", "drafter"}

# Lookup drafting (docs/design.md §3.10): (prompt, outputs already in the suffix index). The prompt's last
# "1 0" recurs at its start, so prompt lookup proposes 0 2 1 0 — the draft model's top-1 after 0
# is 0, so model+lookup keeps the first and drafts on from there; with no repeat in the prompt,
# the suffix index's "0" continues as 0 2 1.
LOOKUPS = {"prompt lookup": ((1, 0, 0, 2, 1, 0), ()), "suffix index": (tuple(PROMPT), ((2, 0, 0, 2, 1),))}
# a lookup's chain at most: exact's payload draws a complement sample at each of its δ rows (4 tokens:
# 1,600–200,000 runs)
LOOKUP_TOKENS = 2
DRAFTER_CELLS = (("lookup", "prompt lookup"), ("lookup", "suffix index"), ("model+lookup", "prompt lookup"))


@dataclass(frozen=True)
class Cell:
    mode: Mode
    payload: Payload
    rule: str  # the draft's child rule ("chain": a sampled chain; "greedy" at T = 0)
    shape: str
    workers: str
    sampling: str
    overlap: bool = False
    option: str = ""  # the secondary option, if any
    spec: SpecOptions = field(compare=False, default=None)  # type: ignore[assignment]
    min_tokens: int = 0
    min_p: float = 0.0  # on top of the sampling (a min_tokens cell's: EOS goes before min-p, vLLM's order)
    transform: str = ""  # a key of TRANSFORMS
    rounds: int = 1  # the decided rounds whose tokens are checked
    lookup: str = ""  # a key of LOOKUPS: the prompt and what the suffix index holds
    # a late draft (app.engine.late): ready after this many rounds, the targets sampling them alone
    late: int = 0

    @property
    def prompt(self) -> list[int]:
        if self.min_p:
            return list(EOS_TOP_PROMPT)
        return list(LOOKUPS[self.lookup][0]) if self.lookup else PROMPT

    @property
    def name(self) -> str:
        parts = [self.mode.value, self.payload.value, self.rule, self.shape, self.workers, self.sampling]
        more = [
            *(["overlap"] if self.overlap else []),
            *([self.option] if self.option else []),
            *([self.lookup] if self.lookup else []),
            *([self.transform] if self.transform else []),
            *([f"draft ready after {self.late} rounds"] if self.late else []),
            *([f"{self.rounds} rounds"] if self.rounds > 1 else []),
        ]
        return " · ".join([*parts, *more])

    @property
    def params(self) -> SamplingParams:
        return replace(SAMPLINGS[self.sampling], min_p=self.min_p) if self.min_p else SAMPLINGS[self.sampling]

    @property
    def claim(self) -> Guarantee:
        return guarantee(self.spec.payload, self.spec.relaxed)


def _spec(mode: Mode, payload: Payload, **options: Any) -> SpecOptions:
    k = TOP_K if payload is Payload.TOP_K else None
    draft_top_k = options.pop(
        "draft_top_k", DRAFT_TOP_K if payload is Payload.SPARSE and "draft_top_p" not in options else 0
    )
    return SpecOptions(
        mode=mode,
        num_draft_tokens=options.pop("gamma", 2),
        k=k,
        reconstruction=options.pop("reconstruction", Reconstruction.RENORMALIZE),
        draft_top_k=draft_top_k,
        draft_top_p=options.pop("draft_top_p", 1.0),
        overlap=options.pop("overlap", False),
        relaxation=options.pop("relaxation", None),
        tree=options.pop("tree", None),
        tree_payload=options.pop("tree_payload", Mode.AGGREGATE),
        pipeline=options.pop("pipeline", None),
        profile=options.pop("profile", False),
        drafter=options.pop("drafter", "model"),
        auto_gamma=options.pop("auto_gamma", False),
    )


# ----------------------------------------------------------------------------- the table of cells

Shape = tuple[str, str, dict[str, Any]]  # a draft shape: its child rule, its label, its SpecOptions fields
LATE_ROUNDS = (1, 2)  # a draft ready after k rounds (k = 0: every other cell)
# A lookup branch in a sampled tree (docs/design.md §3.10): with the priors, ⟨2⟩ becomes the lookup's
# first token and one child drawn from q̂ without it; ⟨2,1⟩ the lookup's two tokens (the second
# under the first, a row with no draft) and the first drawn child with its own.
LOOKUP_TREES = ("⟨2⟩", "⟨2,1⟩")


@functools.cache
def _shapes(mode: Mode, payload: Payload) -> tuple[Shape, ...]:
    """Every draft shape the mode takes."""
    takes = MODES[mode].fields
    if "tree" in takes:
        given = TREE_PAYLOADS[payload][0]
        return tuple(
            (
                rule.value,
                label,
                {"tree": TreeParams(rule=rule, payload=given, **shape).shape(), "tree_payload": Mode(given)},
            )
            for rule in ChildRule
            for label, shape in TREE_SHAPES[rule].items()
        )
    if "pipeline" in takes:
        return tuple((ChildRule.FIXED.value, label, {"pipeline": s}) for label, s in PIPELINE_SHAPES.items())
    if "num_draft_tokens" in takes:
        return tuple(("chain", label, {"gamma": gamma}) for label, gamma in CHAIN_SHAPES.items())
    return (("none", "one token a round", {}),)


def _options(
    mode: Mode, payload: Payload, sampling: str
) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(label, SpecOptions fields, Cell fields) of each further option the mode takes; min_tokens in every
    mode (with min_p at T = 1: the order of the two is vLLM's, EOS first)."""
    takes = MODES[mode].fields
    if "draft_top_k" in takes and payload is not Payload.SPARSE:  # exact's payload truncates so already
        yield "draft top-k 2", {"draft_top_k": 2}, {}
    if "draft_top_p" in takes:
        yield "draft top-p 0.7", {"draft_top_p": 0.7, "draft_top_k": 0}, {}
    if "reconstruction" in takes and payload is Payload.TOP_K:
        yield "residual reconstruction", {"reconstruction": Reconstruction.RESIDUAL}, {}
    if "relaxation" in takes and sampling != "T=0":
        yield "relaxed τ_max 0.5", {"relaxation": Relaxation(0.5, 1.0)}, {}
    if "profile" in takes and sampling in PROFILED:  # timing only: the law must not move, greedy or sampled
        yield "profile", {"profile": True}, {}
    if "num_draft_tokens" in takes:  # two unseeded rounds, each drawing from its own seed (issue 46)
        yield "num_draft_tokens auto from γ 1", {"auto_gamma": True, "gamma": 1}, {"rounds": 2}
    yield "min_tokens 2", {}, {"min_tokens": 2}
    if sampling == "T=1":
        yield f"min_tokens 2, min_p {MIN_P}", {}, {"min_tokens": 2, "min_p": MIN_P}


def _payloads(mode: Mode) -> list[Payload]:
    # engines: test_openai_target
    return [p for p in Payload if p in MODES[mode].payloads and p is not Payload.LOGPROBS]


def _worker_sets(mode: Mode) -> list[str]:
    return list(WORKER_SETS)[:1] if MODES[mode].one_worker else list(WORKER_SETS)


def _cell(
    mode: Mode,
    payload: Payload,
    workers: str,
    sampling: str,
    shape: Shape,
    sets: dict[str, Any] | None = None,
    **fields: Any,
) -> Cell:
    """The cell on ``shape`` with these Cell ``fields``: its SpecOptions the shape's, with its overlap and
    ``sets``."""
    rule, label, options = shape
    spec = _spec(mode, payload, **{**options, "overlap": fields.get("overlap", False), **(sets or {})})
    rule = "greedy" if sampling == "T=0" and rule != "none" else rule
    return Cell(mode, payload, rule, label, workers, sampling, spec=spec, **fields)


def _rows(mode: Mode, payload: Payload, workers: str, sampling: str) -> Iterator[Cell]:
    """What the matrix proves in one mode × payload × worker set × sampling, before ``_sized`` trims it: each
    row below crossed with every draft shape the mode takes."""
    shapes, takes = _shapes(mode, payload), MODES[mode].fields
    at = functools.partial(_cell, mode, payload, workers, sampling)
    # the shapes, with DSD's overlap where the mode takes it (two rounds: the second's draft compared)
    for shape, overlap in itertools.product(shapes, (False, True) if "overlap" in takes else (False,)):
        yield at(shape, overlap=overlap)
    for (label, sets, fields), shape in itertools.product(_options(mode, payload, sampling), shapes):
        yield at(shape, sets, option=label, **fields)
    # the transforms (docs/design.md §3.9): all together over two rounds (the second round checks the
    # session's stored transform, past the call that carried it), then each alone
    for name, shape in itertools.product(["all", *(name for name in TRANSFORMS if name != "all")], shapes):
        yield at(shape, transform=name, rounds=2 if name == "all" else 1)
    if payload is Payload.TOP_K and "reconstruction" in takes:  # σ spread over the grammar's allowed ids only
        residual = {"reconstruction": Reconstruction.RESIDUAL}
        for shape in shapes:
            yield at(shape, residual, option="residual reconstruction", transform="grammar", rounds=2)
    # the drafters (docs/design.md §3.10): lookup chains, δ rows alone or before the model's (a pipeline
    # expands its tree with the model: lookup alone is a 400); in trees, a branch of deterministic children
    if "drafter" in takes:
        for (drafter, lookup), shape in itertools.product(DRAFTER_CELLS, shapes):
            if not (mode is Mode.PIPELINE and drafter == "lookup"):
                yield at(shape, {"drafter": drafter}, option=f"drafter {drafter}", lookup=lookup)
    if mode is Mode.TREE:  # a lookup branch in each sampled tree that forks
        for shape, lookup in itertools.product(shapes, LOOKUPS):
            if shape[0] != ChildRule.FIXED.value and shape[1] in LOOKUP_TREES:
                yield at(shape, {"drafter": "model+lookup"}, option="lookup branch", lookup=lookup)
    # a late draft (issue 49): k rounds without one (the targets sample their token), then the mode's own
    # round, k + 1 checked — on each shape (the mode's last first), with model+lookup's drafter, with overlap
    # (the round after the first draft verifies one prepared in its flight)
    if MODES[mode].drafts:
        for shape, late in itertools.product(shapes[::-1], LATE_ROUNDS):
            yield at(shape, late=late, rounds=late + 1)
        model_lookup = {"drafter": "model+lookup"}
        for shape in shapes if "drafter" in takes else ():
            yield at(
                shape, model_lookup, option="drafter model+lookup", lookup="prompt lookup", late=1, rounds=2
            )
        for shape in shapes if "overlap" in takes else ():
            yield at(shape, {"overlap": True}, option="overlap", late=1, rounds=3)


BIG_TREES = ("⟨2,1⟩", "nodes 3 depth 2 top-2")  # the trees of three nodes
# the trees whose two rounds with every transform stay under ~1,200 runs with one worker (``_sized``)
TWO_ROUND_TREES = ("⟨1⟩", "nodes 1", "top-1 chain of 2", "nodes 2 depth 2 top-2 (prunes to a chain)")


def _sized(cell: Cell) -> Cell | None:
    """The cell as the matrix runs it, or None where cheaper cells prove its law: every trim, with what it
    saves. Exact's payload draws a complement sample per row and worker, every one enumerated: with two
    workers it keeps to trees of one or two nodes and leaves one id off (the complement is then a draw at the
    leaves only; one worker keeps two off)."""
    two, tree = len(WORKER_SETS[cell.workers]) > 1, cell.mode is Mode.TREE
    exact_two = two and cell.payload is Payload.SPARSE
    one_t1 = (cell.payload, cell.workers, cell.sampling) == (Payload.FULL, "1 worker", "T=1")
    drafter = cell.option.startswith("drafter") and not cell.late
    shapes = [s for s in _shapes(cell.mode, cell.payload) if not (tree and exact_two and s[1] in BIG_TREES)]
    # the one shape of an option, a transform alone, a drafter, a late draft: the mode's last (a pipeline's
    # first: its expanding tree is 1,100 runs, 18 s a cell, and 1,100 to over 3,000 a transform)
    rides: Shape | None = shapes[0] if cell.mode is Mode.PIPELINE else shapes[-1]
    if not (cell.option or cell.transform or cell.late) or cell.option in ("lookup branch", "overlap"):
        rides = None  # every shape: the plain cells, the lookup branches, a late draft with overlap (γ = 1)
    elif cell.option == "residual reconstruction" and cell.transform:
        rides = shapes[0]  # the residual fill under the grammar: the mode's first shape
    elif drafter and cell.mode is Mode.PIPELINE:
        rides = shapes[1]  # not its expanding tree with a branch: 2,000 runs, 22 s
    elif cell.transform == "all" and not cell.option and cell.sampling in ("T=0", "T=1"):
        # every shape, but a tree's on exact's payload with two workers at T = 1 (their complement draws under
        # each node: 17 s for every shape)
        rides = rides if tree and exact_two and cell.sampling == "T=1" else None
    elif tree and one_t1 and (cell.rule, cell.shape, cell.late, cell.option) == ("sampled", "⟨2⟩", 1, ""):
        rides = None  # a late draft in a sampled tree too
    dropped = (
        tree and exact_two and cell.shape in BIG_TREES,  # 12,000–17,000 runs (70–90 s) a cell
        # off the shape it rides (both sampled rules have a ⟨1⟩: the tree tells them apart)
        rides is not None and (cell.shape, cell.spec.tree) != (rides[1], rides[2].get("tree")),
        # two rounds enumerated: γ = 1 (γ = 2 takes ~9,000 runs a cell)
        cell.spec.overlap and cell.spec.num_draft_tokens > 1,
        # two workers' complement of two ids per row (6,000 runs); with auto γ, over two rounds (19,000 runs,
        # 74 s): one worker has them
        exact_two and (cell.spec.draft_top_p < 1 or cell.spec.auto_gamma),
        # two workers' complement draws at every δ row (7,800–9,200 runs a cell at T = 1): lookup alone, from
        # the prompt, with T = 0 and the truncated samplings (top-k 2: 96 runs); none in a tree (exact's chain
        # cell has it, 7,800 runs there; the lookup branch cells run two workers)
        drafter and exact_two and (cell.option, cell.lookup) != ("drafter lookup", "prompt lookup"),
        drafter and exact_two and (tree or cell.sampling == "T=1"),
        # the two-token branch on one payload and worker set: its law is the walk's, not the payload's
        cell.option == "lookup branch"
        and cell.shape == "⟨2,1⟩"
        and (cell.payload, cell.workers, cell.lookup) != (Payload.FULL, "1 worker", "prompt lookup"),
        cell.option == "lookup branch" and exact_two and cell.lookup != "prompt lookup",
        # a late draft: ready after one round at T = 0 and T = 1 (two workers on exact's payload: T = 0 and
        # top-k 2, each complement draw enumerated), after two with one worker at T = 1 but on exact's payload
        # (each round without a draft multiplies the runs by V: 1,800); model+lookup's on aggregate's rows
        cell.late
        and cell.option != "overlap"
        and cell.sampling not in ("T=0", "T=1 top-k 2" if exact_two else "T=1"),
        cell.late > 1 and (two or cell.sampling != "T=1" or cell.payload is Payload.SPARSE),
        cell.late and cell.option == "drafter model+lookup" and not (cell.mode is Mode.AGGREGATE and one_t1),
        # with overlap (three rounds), one cell: at T = 1 it is 32,000 runs
        cell.option == "overlap"
        and (cell.mode, cell.payload, cell.workers, cell.sampling)
        != (Mode.AGGREGATE, Payload.FULL, "1 worker", "T=1 top-k 2"),
    )
    if any(dropped):
        return None
    if exact_two and cell.spec.draft_top_k == DRAFT_TOP_K:
        cell = replace(cell, spec=replace(cell.spec, draft_top_k=V - 1))
    # every transform over two rounds: the grammar's forced runs hang below a tree's leaves too, so a chain of
    # γ = 1 and the trees of one node or one chain of two stay under ~1,200 runs with one worker; γ = 2 takes
    # 3,700, ⟨2⟩ 500–3,200, ⟨2,1⟩ 12,000–49,000 and ⟨1,1⟩ on exact's payload 2,500, and exact's payload with
    # two workers 2,500–81,000 (one worker: its chains of two, 850–1,000)
    nodes = cell.spec.tree is not None and cell.shape not in ("⟨1⟩", "nodes 1")  # a tree past one node
    small = cell.shape in ("γ=1", *TWO_ROUND_TREES) or not (cell.spec.tree or cell.shape in CHAIN_SHAPES)
    one_round = cell.payload is Payload.SPARSE and (two or nodes) or not small
    return replace(cell, rounds=1) if cell.transform == "all" and one_round else cell


def cells() -> list[Cell]:
    """Every cell of the matrix, in the table's order: each mode × payload × worker set × sampling's rows
    (``_rows``), as ``_sized`` runs them."""
    table = (
        _rows(mode, payload, workers, sampling)
        for mode in MODES
        for payload in _payloads(mode)
        for workers, sampling in itertools.product(_worker_sets(mode), SAMPLINGS)
    )
    return [sized for cell in itertools.chain.from_iterable(table) if (sized := _sized(cell)) is not None]


FULL = bool(os.environ.get("SPECGATE_FULL_STATISTICS"))


def _in_default_run(cell: Cell) -> bool:
    """Every cell with SPECGATE_FULL_STATISTICS=1. By default, an option (a secondary field, a transform, a
    drafter, a lookup branch, overlap) with two workers is crossed with the truncated samplings (top-k, top-p)
    and T = 0, not with plain T = 1 — the two workers' law under the option is the same check with fewer
    branches there (a third of the matrix's runs), and T = 1 has the option with one worker and every shape
    with two but the largest sampled trees (those with two workers at top-k and top-p, and with one at T = 1).
    A pipeline's expanding tree at plain T = 1: with every transform over two rounds (the plain cell, 1,129
    runs, with the full run). A late draft: ready after one round in every mode and payload (two workers at T
    = 0; their sampled law is tests/app/test_late_draft.py's chi-square), after two on aggregate's full
    rows."""
    two_workers = len(WORKER_SETS[cell.workers]) > 1
    if cell.late and not FULL:
        # a late draft: k = 1 in every mode and payload (two workers greedy), k = 2 on aggregate's full rows
        return (not two_workers or cell.sampling == "T=0") and (
            cell.late == 1 or (cell.mode is Mode.AGGREGATE and cell.payload is Payload.FULL)
        )
    option = bool(cell.option or cell.transform or cell.lookup or cell.overlap)
    if cell.transform and cell.payload is Payload.SPARSE and cell.shape == "⟨2,1⟩" and cell.sampling == "T=1":
        # 1,700 runs: the transforms on the sampled ⟨2,1⟩ at T = 1 run on the full payload (and top-k),
        # exact's payload on the smaller trees
        return FULL
    if (
        cell.mode is Mode.PIPELINE
        and "expanding" in cell.shape
        and cell.sampling == "T=1"
        and not (option or cell.late)
    ):
        # 1,129 runs, 13 s (12,445 expansions): by default its law at T = 1 is the cell with every
        # transform's, two rounds (68 runs, 187 expansions)
        return FULL
    if (
        cell.mode is Mode.TREE
        and two_workers
        and cell.sampling == "T=1"
        and (cell.shape == "⟨2,1⟩" or (cell.payload is Payload.SPARSE and cell.shape in ("⟨2⟩", "⟨1,1⟩")))
    ):
        # 6,800 runs: two workers' sampled trees at T = 1 on the smaller shapes (exact's payload: ⟨1⟩ and the
        # fixed ones); these shapes with one worker at T = 1 and with two at top-k and top-p
        return FULL
    return FULL or not (two_workers and option and cell.sampling == "T=1")


ALL_CELLS = cells()  # what tests/app/test_golden_matrix.py records, every run
CELLS = [cell for cell in ALL_CELLS if _in_default_run(cell)]


# ----------------------------------------------------------------------------- the law of a cell


def _engine(cell: Cell) -> Engine:
    weights = WORKER_SETS[cell.workers]
    if cell.mode is Mode.PIPELINE:
        return with_table_grammar(
            pipeline_engine(DRAFT, split_pipeline(TARGETS[0].table, [1], 2, eos_ids=[EOS]), eos_ids=[EOS])
        )
    return with_table_grammar(make_engine(DRAFT, list(zip(TARGETS, weights)), eos_ids=[EOS]))


# the tokens checked, the bound reported at the first, the second round's draft (overlap)
Outcome = tuple[tuple[int, ...], float, Any]


class _SecondDraft(Exception):
    """Raised by ``_Recording`` at the second round: what it was to verify."""

    def __init__(self, draft: TokenTree) -> None:
        # q̂ per row, pads dropped
        rows = tuple(tuple(zip(*(t.tolist() for t in draft.support(node)))) for node in range(-1, len(draft)))
        self.signature = (tuple(draft.ids()), tuple(draft.parents.tolist()), draft.rule.value, rows)


class _Recording(RoundStrategy):
    """The mode's strategy for the first round; at the second, the draft it was given, and no verdict."""

    def __init__(self, inner: RoundStrategy, stop_at: int = 2) -> None:
        self.inner, self.rounds, self.stop_at = inner, 0, stop_at

    async def verify(self, rnd: Round) -> RoundResult:
        self.rounds += 1
        if self.rounds >= self.stop_at:
            raise _SecondDraft(rnd.draft)
        return await self.inner.verify(rnd)


def cell_law(cell: Cell) -> tuple[dict[Outcome, float], int, float]:
    """The exact law of the cell's checked tokens, how many runs it took, and its seconds. With
    overlap: the first round's tokens and the second round's draft, with overlap and without it
    (the second round verifies the same draft by the same code: the laws must be equal)."""
    started = time.perf_counter()
    if not cell.overlap:
        law, runs = _law(cell, cell.spec, second_draft=False)
        return law, runs, time.perf_counter() - started
    law, runs = _law(cell, cell.spec, second_draft=True)
    plain, more = _law(cell, replace(cell.spec, overlap=False), second_draft=True)
    return (
        {("with overlap", *key): mass for key, mass in law.items()}
        | {("without", *key): mass for key, mass in plain.items()},
        runs + more,
        time.perf_counter() - started,
    )


def _law(cell: Cell, spec: SpecOptions, second_draft: bool) -> tuple[dict[Outcome, float], int]:
    engine = _engine(cell)
    loop = asyncio.new_event_loop()
    count = itertools.count()
    inner = STRATEGIES[cell.spec.verifier]
    # a pipeline's own loop: no rounds to record
    recording = (
        _Recording(inner, stop_at=2 if second_draft else cell.rounds + 1)
        if isinstance(inner, RoundStrategy)
        else inner
    )

    async def once() -> Outcome:
        engine.draft.lookup.params = LookupParams(max_tokens=LOOKUP_TOKENS)
        # what each run's lookup sees: the cell's, not earlier runs' outputs
        engine.draft.lookup.suffixes = SuffixIndex(engine.draft.lookup.params)
        # and its measured rates: the priors, whatever ran before
        engine.draft.lookup.acceptance = AcceptanceStats()
        for output in LOOKUPS[cell.lookup][1] if cell.lookup else ():
            engine.draft.lookup.suffixes.add(list(output))
        req = GenerationRequest(
            request_id=f"m{next(count)}",
            prompt=cell.prompt,
            max_tokens=MAX_TOKENS,
            params=cell.params,
            seed=SEED,
            choice=0,
            spec=spec,
            seeded=cell.lookup != "suffix index" and not spec.auto_gamma,
            min_tokens=cell.min_tokens,
            transform=TRANSFORMS.get(cell.transform),
            draft_after=cell.late,
        )
        tokens: list[int] = []
        bound, seen, drafted = 0.0, 0, None
        if isinstance(recording, _Recording):
            recording.rounds = 0
        try:
            async with aclosing(engine.generate(req)) as results:
                async for result in results:
                    if not tokens and result.tokens:  # τ(1 − β) to p̂, then p̂ to p
                        bound = (result.lossy.relaxed_tv or [0.0])[0] + (result.lossy.bound or [0.0])[0]
                    tokens += result.tokens
                    # forced tokens take no round
                    seen += (
                        result.pipeline.rounds_ended
                        if cell.mode is Mode.PIPELINE
                        else int(bool(result.tokens) and not result.drafting.forced)
                    )
                    if (seen >= cell.rounds and not second_draft) or result.finish_reason:
                        break
        except _SecondDraft as second:
            drafted = second.signature
        return tuple(tokens), bound, drafted

    def run() -> Outcome:
        outcome = loop.run_until_complete(once())
        loop.run_until_complete(_cancel_the_rest())  # a pipeline's segments still in flight
        return outcome

    strategies = dict(loop_module.STRATEGIES)
    loop_module.STRATEGIES[cell.spec.verifier] = recording
    try:
        with ExactDraws() as draws:
            law = draws.law(run)
    finally:
        loop_module.STRATEGIES.clear()
        loop_module.STRATEGIES.update(strategies)
        loop.close()
    return law, draws.runs


async def _cancel_the_rest() -> None:
    left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)


def transformed(logits: torch.Tensor, generated: tuple[int, ...], spec: TransformSpec) -> torch.Tensor:
    # [V] fp32
    """docs/design.md §3.9 from its definition, token by token in the workers' fp32 arithmetic: + bias,
    the repetition penalty over prompt and output, presence and frequency over the output, the mask."""
    out = logits.float().clone()
    for token, bias in spec.logit_bias:
        out[token] += torch.tensor(bias, dtype=torch.float32)
    if spec.repetition_penalty != 1:
        for token in set(PROMPT) | set(generated):
            out[token] = (
                out[token] / spec.repetition_penalty
                if out[token] > 0
                else out[token] * spec.repetition_penalty
            )
    for token in set(generated):
        out[token] -= (
            torch.tensor(float(generated.count(token))) * spec.frequency_penalty + spec.presence_penalty
        )
    if spec.grammar is not None:
        out[~TableMatcher.allowed_after(generated)] = float("-inf")
    return out


def target_next(cell: Cell, last: int, generated: int, prefix: tuple[int, ...] = ()) -> torch.Tensor:
    # [V] float64
    """The target after ``last`` with ``generated`` tokens so far (``prefix``: those tokens,
    which a transform reads), from the definitions and not
    the serving code: Σ w_n T(p_n), each T(p_n) the worker's own fp32 row normalised in float64;
    before ``min_tokens`` each worker's EOS logit at −∞ first, before the transform and the
    sampling (vLLM's order); at T = 0 the argmax of the rows as they are."""
    weights = torch.tensor(WORKER_SETS[cell.workers], dtype=torch.float64)
    weights = weights / weights.sum()
    spec = TRANSFORMS.get(cell.transform)
    raw = [t.table[last].float() for t in TARGETS[: len(weights)]]
    if generated < cell.min_tokens:
        raw = [row.index_fill(0, torch.tensor([EOS]), float("-inf")) for row in raw]
    logits = [row if spec is None else transformed(row, prefix, spec) for row in raw]
    rows = [apply_sampling(row[None], cell.params)[0] for row in logits]
    p = sum(
        (w * (row.double() if cell.params.is_greedy else normalised(row)) for w, row in zip(weights, rows)),
        torch.zeros(V, dtype=torch.float64),
    )
    if cell.params.is_greedy:
        return torch.nn.functional.one_hot(torch.argmax(p), V).double()  # argmax: the lowest id of the ties
    return p


def prefix_distance(cell: Cell, law: dict[tuple[int, ...], float]) -> float:
    """``tests.draws.prefix_distance`` from the cell's target (``target_next``)."""
    rows: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = {}

    def p_next(prefix: tuple[int, ...]) -> torch.Tensor:
        key = (prefix[-1] if prefix else cell.prompt[-1], len(prefix), prefix if cell.transform else ())
        if key not in rows:
            rows[key] = target_next(cell, *key)
        return rows[key]

    return draws_prefix_distance(law, p_next, EOS, V)


def tokens_law(law: dict[Outcome, float]) -> dict[tuple[int, ...], float]:
    out: dict[tuple[int, ...], float] = {}
    for (tokens, _, _), mass in law.items():
        out[tokens] = out.get(tokens, 0.0) + mass
    return out


# ----------------------------------------------------------------------------- running the matrix


def _run_cells(names: list[str]) -> dict[str, tuple[dict[Outcome, float], int, float]]:
    torch.set_num_threads(1)
    by_name = {c.name: c for c in CELLS}
    return {name: cell_law(by_name[name]) for name in names}


@pytest.fixture(scope="module")
def laws() -> dict[str, tuple[dict[Outcome, float], int, float]]:
    """Every cell's law, the cells dealt out to two processes (one per core; this process where
    it has one)."""
    names = [c.name for c in CELLS]
    with seed_pool() as pool:
        parts = pool.map(_run_cells, [names[i::8] for i in range(8)])
        out: dict[str, tuple[dict[Outcome, float], int, float]] = {}
        for part in parts:
            out.update(part)
    return out


@pytest.mark.parametrize("cell", CELLS, ids=[c.name for c in CELLS])
def test_cell(cell: Cell, laws: dict[str, tuple[dict[Outcome, float], int, float]]) -> None:
    law, _, _ = laws[cell.name]
    if cell.overlap:  # the same law with overlap as without, the second round's draft included
        with_overlap = {key[1:]: mass for key, mass in law.items() if key[0] == "with overlap"}
        without = {key[1:]: mass for key, mass in law.items() if key[0] == "without"}
        assert (
            max(abs(with_overlap.get(k, 0.0) - without.get(k, 0.0)) for k in {*with_overlap, *without})
            <= TOLERANCE
        )
        return
    assert abs(sum(law.values()) - 1) < TOLERANCE
    tokens = tokens_law(law)
    if cell.transform and TRANSFORMS[cell.transform].grammar is not None:
        # lossy or not, nothing the grammar masks
        assert all(TableMatcher.allowed_after(t[:i])[t[i]] for t in tokens for i in range(len(t))), (
            "a token the grammar masks"
        )
    if cell.claim is Guarantee.LOSSLESS:
        assert prefix_distance(cell, tokens) <= TOLERANCE
        return
    first: dict[tuple[int, ...], float] = {}
    for key, mass in tokens.items():
        first[key[:1]] = first.get(key[:1], 0.0) + mass
    tv = 0.5 * sum(
        abs(first.get((t,), 0.0) - float(target_next(cell, cell.prompt[-1], 0)[t])) for t in range(V)
    )
    # σ travels as fp32: equal to the TV up to its rounding
    bound = sum(mass * b for (_, b, _), mass in law.items())
    assert tv <= bound * (1 + 2**-23) + TOLERANCE, (
        f"TV {tv:.3e} at the first token above the reported bound {bound:.3e}"
    )


# ----------------------------------------------------------------------------- what the matrix covers


def _literals(annotation: Any) -> set[str]:
    """The string values of a ``Literal[...] | None`` annotation."""
    out: set[str] = set()
    for arg in get_args(annotation):
        out |= (
            {a for a in get_args(arg) if isinstance(a, str)}
            if get_args(arg)
            else ({arg} if isinstance(arg, str) else set())
        )
    return out


def test_the_matrix_covers_every_registry() -> None:
    """A mode, field, payload, child rule, reconstruction or tree payload that the generator does
    not know fails here: it must be taught to the matrix, not left untested."""
    known = PRIMARY_FIELDS | SECONDARY_FIELDS
    for mode in MODES:
        assert MODES[mode].fields <= known, (
            f"mode {mode.value} takes {sorted(MODES[mode].fields - known)}: enumerate them in the matrix"
        )
        for payload in MODES[mode].payloads - {Payload.LOGPROBS}:
            assert any(c.mode is mode and c.payload is payload for c in CELLS), (
                f"no cell for {mode.value} on {payload.value}"
            )
    assert set(GUARANTEES) == set(Payload)
    # an engine's rows are a worker's top-k (test_openai_target): the TOP_K cells' bound
    assert GUARANTEES[Payload.LOGPROBS] is Guarantee.BOUNDED
    assert {c.rule for c in CELLS if c.mode is Mode.TREE} == {*(r.value for r in ChildRule), "greedy"}
    assert {c.spec.reconstruction for c in CELLS if c.payload is Payload.TOP_K} == set(Reconstruction)
    assert {c.spec.tree_payload.value for c in CELLS if c.mode is Mode.TREE} == _literals(
        TreeParams.model_fields["payload"].annotation
    )
    assert {c.sampling for c in CELLS} == set(SAMPLINGS) and {c.workers for c in CELLS} == set(WORKER_SETS)
    assert {c.claim for c in CELLS} == set(Guarantee)
    assert any(c.overlap for c in CELLS) and any(c.min_tokens for c in CELLS)
    # a drafter registered without cells of its own fails here
    assert {c.spec.drafter for c in CELLS} == set(DRAFTERS)
    for cell in CELLS:
        # the generator's label is what the engine computes, and the response claims what the table says
        assert cell.spec.payload is cell.payload and cell.spec.is_lossless == (
            cell.claim is Guarantee.LOSSLESS
        )


def first_draft(cell: Cell) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(ids, parents) of the tree the cell's first round verifies (a fixed tree does not depend
    on the draws)."""
    loop = asyncio.new_event_loop()
    inner = STRATEGIES[cell.spec.verifier]
    assert isinstance(inner, RoundStrategy)
    recording = _Recording(inner, stop_at=1)
    strategies = dict(loop_module.STRATEGIES)
    loop_module.STRATEGIES[cell.spec.verifier] = recording

    async def once() -> Any:
        req = GenerationRequest(
            request_id="m",
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            params=cell.params,
            seed=SEED,
            choice=0,
            spec=cell.spec,
            seeded=True,
        )
        try:
            async with aclosing(_engine(cell).generate(req)) as results:
                async for _ in results:
                    pass
        except _SecondDraft as first:
            return first.signature
        raise AssertionError("no round was verified")

    try:
        ids, parents, _, _ = loop.run_until_complete(once())
    finally:
        loop_module.STRATEGIES.clear()
        loop_module.STRATEGIES.update(strategies)
        loop.close()
    return ids, parents


def test_the_degenerate_shapes_are_in_the_matrix() -> None:
    """The shapes are not only configured but drafted: one node; a fixed chain of two rows whose
    leaf bonus is emitted; a fixed tree that prunes to a chain; a fixed tree that forks."""
    trees = [c.spec.tree for c in CELLS if c.spec.tree is not None]
    fixed = [t for t in trees if t.rule is ChildRule.FIXED]
    assert (
        any(t.nodes == 1 for t in fixed)
        and any(t.top_k == 1 and t.nodes > 1 for t in fixed)
        and any(t.depth == 1 for t in fixed)
    )
    assert {(1,), (1, 1)} <= {t.widths for t in trees if t.rule is not ChildRule.FIXED}
    exact = {
        c.shape: c
        for c in CELLS
        if c.mode is Mode.TREE
        and c.payload is Payload.SPARSE
        and c.rule == "fixed"
        and c.workers == "1 worker"
        and c.sampling == "T=1"
        and not c.option
    }
    assert first_draft(exact["nodes 1"])[1] == (-1,)
    assert first_draft(exact["top-1 chain of 2"])[1] == (-1, 0)
    assert first_draft(exact["nodes 2 depth 2 top-2 (prunes to a chain)"])[1] == (-1, 0)  # pruned to a chain
    # a fork at the root
    assert first_draft(exact["nodes 3 depth 2 top-2"])[1] in {(-1, 0, -1), (-1, -1, 0), (-1, -1, 1)}
    law, _, _ = cell_law(exact["top-1 chain of 2"])
    # both rows accepted, the leaf's bonus emitted
    assert sum(mass for (tokens, _, _), mass in law.items() if len(tokens) == 3) > 0
    schedules = [c.spec.pipeline for c in CELLS if c.spec.pipeline is not None]
    assert any(s.tree.nodes == 1 for s in schedules) and any(
        s.tree.top_k == 1 and s.tree.nodes > 1 for s in schedules
    )


# ----------------------------------------------------------------------------- negative controls


def _fails(cell: Cell) -> bool:
    try:
        test_cell(cell, {cell.name: cell_law(cell)})
    except AssertionError:
        return True
    return False


def test_negative_control_the_chain_shortcut_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug this matrix was built for (issue 32): a chain of fixed children sent to the chain
    verifier under exact's payload. Put back, the matrix rejects it — with one worker and two."""
    monkeypatch.setattr(TokenTree, "is_sampled_chain", property(lambda tree: tree.is_chain))
    # the chains it takes
    shapes = (
        {c.shape for c in CELLS if c.mode is Mode.TREE and c.rule == "fixed"}
        if FULL
        else {"nodes 1", "top-1 chain of 2"}
    )
    caught = [
        c
        for c in CELLS
        if c.mode is Mode.TREE
        and c.payload is Payload.SPARSE
        and c.rule == "fixed"
        and c.shape in shapes
        and c.sampling == "T=1"
        and not c.option
        and _fails(c)
    ]
    assert {c.shape for c in caught} >= {"nodes 1", "top-1 chain of 2"} and {
        c.workers for c in caught
    } == set(WORKER_SETS)


def test_negative_control_algorithm_5_on_fixed_children_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampled rule min(1, p'/q̂) on children chosen as the top-k (docs/design.md §3.6) is biased: the
    matrix rejects it on aggregate's payload and on exact's, for chains and trees alike."""
    real = tree_math.try_children

    def sampled_rule(
        p: torch.Tensor,
        q: torch.Tensor,
        candidates: list[int],
        rule: ChildRule,
        accept_u: torch.Tensor,
        deterministic: int = 0,
    ) -> Any:
        return real(
            p, q, candidates, ChildRule.SAMPLED if rule is ChildRule.FIXED else rule, accept_u, deterministic
        )

    monkeypatch.setattr(tree_math, "try_children", sampled_rule)
    picked = [
        c
        for c in CELLS
        if c.mode is Mode.TREE
        and c.rule == "fixed"
        and c.workers == "1 worker"
        and c.sampling == "T=1"
        and not c.option
    ]
    caught = {(c.payload, c.shape) for c in picked if c.payload is not Payload.TOP_K and _fails(c)}
    assert {
        (Payload.FULL, "nodes 3 depth 2 top-2"),
        (Payload.SPARSE, "nodes 3 depth 2 top-2"),
        (Payload.FULL, "nodes 1"),
    } <= caught


def _caught(picked: list[Cell]) -> set[str]:
    return {c.name for c in picked if _fails(c)}


def _one_each(cells: list[Cell], key: Any) -> list[Cell]:
    """A control's cells: all of them with SPECGATE_FULL_STATISTICS=1; by default the first of
    each ``key`` — what the control must still be caught in (the cells of one key differ only
    in what the control does not touch: shapes, samplings, worker sets)."""
    if FULL:
        return cells
    seen: set[Any] = set()
    out = []
    for cell in cells:
        if key(cell) not in seen:
            seen.add(key(cell))
            out.append(cell)
    return out


def test_negative_control_a_verifier_without_the_residual_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The classic bug: at a rejection, resample from p, not norm(max(0, p − q̂)) — caught in
    every sampled chain and tree (fixed children do not use that residual: they zero and renormalise)."""
    monkeypatch.setattr(tree_math, "residual", lambda p, q: p.double() / p.double().sum())
    picked = [
        c
        for c in CELLS
        if c.mode in (Mode.AGGREGATE, Mode.TREE)
        and c.payload is Payload.FULL
        and c.sampling == "T=1"
        and c.workers == "1 worker"
        and not c.option
        and not c.overlap
    ]
    picked = _one_each(picked, lambda c: (c.mode, c.rule, c.transform))
    assert _caught(picked) == {c.name for c in picked if c.rule != "fixed"}


def test_split_draws_at_a_rejection_on_the_worker_when_its_draft_is_cut_and_a_skipped_residual_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 61: ``split`` on whole rows with a truncated draft sends q̂ on the draft's supports and the
    worker draws the token at a rejection (no row back): those cells keep the law above; a worker that draws
    it from p instead of norm(max(0, p − q̂)) is caught in each where p is not a point mass at the
    rejections."""
    import workers.scoring as scoring

    # the break is the host scorer's (the device's: test_workers_that_score_a_step_on_the_device…)
    monkeypatch.setenv("SPECGATE_WORKER_SCORING", "host")
    picked = [
        c
        for c in CELLS
        if c.mode is Mode.SPLIT
        and c.payload is Payload.FULL
        and c.option.startswith("draft top")
        and c.sampling != "T=0"
    ]
    assert len(picked) >= 4
    sent: list[bool] = []
    real = scoring.split_residual_draw
    monkeypatch.setattr(scoring, "split_residual_draw", lambda *args: sent.append(True) or real(*args))
    assert not _caught(picked) and sent  # the worker drew them
    monkeypatch.setattr(scoring, "residual", lambda p, q: p.double() / p.double().sum())
    # top-p 0.8 leaves t0 a point mass after 0, 2 and 3: residual = p there
    spread = {c.name for c in picked if c.sampling != "T=0.8 top-p 0.8"}
    assert len(spread) >= 4 and _caught(picked) >= spread


def test_negative_control_a_lookup_token_tested_as_a_draw_from_a_spread_q_hat_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lookup token is drawn from δ (docs/design.md §3.10). Sent with a row that says it was drawn from
    a spread q̂ (uniform here: min(1, p/q̂) at the test, max(0, p − q̂) at a rejection), the law
    moves — caught in every lossless lookup cell at T = 1 (alone and before the model's tokens)."""
    from app.drafting import chain, lookup, tree

    for module in (chain, lookup, tree):  # where a lookup token's row is made
        monkeypatch.setattr(
            module,
            "delta",
            lambda token, vocab: torch.full((vocab,), 1.0 / vocab, dtype=torch.float64),
            raising=False,
        )
        monkeypatch.setattr(
            module,
            "delta_support",
            lambda token: (torch.arange(V), torch.full((V,), 1.0 / V, dtype=torch.float64)),
            raising=False,
        )
    chains = (Mode.AGGREGATE, Mode.SPLIT, Mode.EXACT)
    picked = [
        c
        for c in CELLS
        if c.lookup
        and c.sampling == "T=1"
        and c.claim is Guarantee.LOSSLESS
        and not c.late
        and (c.mode in chains or c.option == "drafter lookup")
    ]
    assert len(picked) >= 10 and _caught(picked) == {c.name for c in picked}


def test_lookup_tokens_kept_against_the_models_top_1_keep_the_law(monkeypatch: pytest.MonkeyPatch) -> None:
    """model+lookup keeps a lookup token the draft model disagrees with once lookups measure better
    than model tokens (here the priors say so): the run 0 2 is kept whole where the model's top-1
    after 0 is 0, and every chain cell's law (or bound) still holds."""
    from app.drafting import lookup

    monkeypatch.setattr(lookup, "MODEL_PRIOR", 0.1)
    picked = [
        c
        for c in CELLS
        if c.option == "drafter model+lookup"
        and c.mode in (Mode.AGGREGATE, Mode.SPLIT, Mode.EXACT)
        and c.workers == "1 worker"
    ]
    assert len(picked) >= 8 and not _caught(picked)


def test_negative_control_a_lookup_child_tested_with_min_1_p_over_q_hat_in_a_tree_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tree's lookup child tested as a draw from its parent's q̂ (min(1, p'/q̂), the residual
    after it) instead of the fixed rule: caught in the sampled trees' lookup branch cells at T = 1
    (a fixed tree's children take the fixed rule anyway)."""
    real = tree_math.try_children

    def as_drawn(
        p: torch.Tensor,
        q: torch.Tensor,
        candidates: list[int],
        rule: ChildRule,
        accept_u: torch.Tensor,
        deterministic: int = 0,
    ) -> Any:
        return real(p, q, candidates, rule, accept_u, 0)

    monkeypatch.setattr(tree_math, "try_children", as_drawn)
    picked = [
        c
        for c in CELLS
        if c.option == "lookup branch" and c.sampling == "T=1" and c.claim is Guarantee.LOSSLESS
    ]
    assert len(picked) >= 8 and _caught(picked) == {c.name for c in picked}


def test_negative_control_min_tokens_the_workers_do_not_apply_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The transform sent without min_tokens: the draft keeps EOS out, the workers' rows do not.
    Caught in every lossless min_tokens cell at T = 1, in every mode."""
    real = TransformSpec.to_wire
    monkeypatch.setattr(TransformSpec, "to_wire", lambda self: real(replace(self, min_tokens=0)))
    picked = _one_each(
        [c for c in CELLS if c.min_tokens and c.sampling == "T=1" and not c.min_p],
        lambda c: (c.mode, c.payload, c.workers),
    )
    lossless = {c.name for c in picked if c.claim is Guarantee.LOSSLESS}
    assert {c.mode for c in picked} == set(MODES) and lossless <= _caught(picked)


def test_negative_control_eos_removed_after_min_p_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The order this replaced: EOS taken out of each worker's T(p) after temperature and min-p
    (zeroed there, renormalised by the readers), not out of its logits first. Caught in the min_p
    cells of every mode."""
    from core import transform as transform_module
    from workers import scoring

    real_rows, real_sampling, early = (
        transform_module.LogitsTransform.rows,
        scoring.apply_sampling,
        set[int](),
    )

    def rows_keeping_eos(
        self: Any, logits: torch.Tensor, agreed: list[int], paths: list[list[int]]
    ) -> torch.Tensor:
        early.clear()
        # the worker's next sampling zeroes EOS there
        early.update(self._early_rows(agreed, paths) if self.spec.suppresses else ())
        return real_rows(
            transform_module.LogitsTransform(replace(self.spec, min_tokens=0), self.vocab_size, self.matcher),
            logits,
            agreed,
            paths,
        )

    def sampling_then_eos(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        probs = real_sampling(logits, params)
        rows = [r for r in early if r < probs.shape[0] and float(probs[r].sum() - probs[r, EOS]) > 0]
        probs[rows, EOS] = 0.0
        early.clear()
        return probs

    monkeypatch.setenv("SPECGATE_WORKER_SCORING", "host")  # the break is in the host's transform and sampling
    monkeypatch.setattr(transform_module.LogitsTransform, "rows", rows_keeping_eos)
    monkeypatch.setattr(scoring, "apply_sampling", sampling_then_eos)
    picked = [c for c in CELLS if c.min_p and c.claim is Guarantee.LOSSLESS and c.workers == "1 worker"]
    assert {c.mode for c in picked} == set(MODES) and _caught(picked) == {c.name for c in picked}


def test_negative_control_a_pipeline_walk_that_keeps_the_rejected_mass_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pipeline's walk drawing the recovered token from p, not from p' (the rejected children
    not zeroed)."""
    real = pipeline_strategy.try_children

    def kept_mass(
        p: torch.Tensor, q: torch.Tensor, candidates: list[int], rule: ChildRule, accept_u: torch.Tensor
    ) -> Any:
        return real(p, q, candidates, rule, accept_u)[0], p.double()

    monkeypatch.setattr(pipeline_strategy, "try_children", kept_mass)
    # the expanding tree: 40 s more
    picked = [
        c
        for c in CELLS
        if c.mode is Mode.PIPELINE
        and c.sampling == "T=1"
        and not c.option
        and not c.transform
        and "expanding" not in c.shape
    ]
    assert _caught(picked) == {c.name for c in picked}


def test_negative_control_a_transform_from_the_parents_row_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every scored row transformed as the round's first row (penalty counts not advanced along the path, the
    grammar's mask taken before the draft's tokens): caught in every drafting lossless cell, with every
    transform (the penalties and the grammar together; each alone too with SPECGATE_FULL_STATISTICS=1).
    (Autoregressive scores one row; the top-k cells' check is the first row's bound.)"""
    from workers.stage import StageSide
    from workers.step import Steps

    def parents_row(real: Any) -> Any:
        def shaping(self: Any, req: Any, *more: Any) -> Any:
            got = real(self, req, *more)
            return None if got is None else (got[0], got[1], [[] for _ in got[2]])

        return shaping

    monkeypatch.setattr(Steps, "_shaping", parents_row(Steps._shaping))
    monkeypatch.setattr(StageSide, "shaping", parents_row(StageSide.shaping))
    # "all": the penalties and the grammar together
    transforms = ("all", "presence + frequency", "grammar") if FULL else ("all",)
    picked = [
        c for c in CELLS if c.transform in transforms and c.workers == "1 worker" and c.sampling == "T=1"
    ]
    picked = _one_each(picked, lambda c: (c.mode, c.payload, c.transform, c.rule))
    expected = {c.name for c in picked if c.claim is Guarantee.LOSSLESS and MODES[c.mode].drafts}
    caught = _caught(picked)
    assert expected and expected <= caught  # and lossy cells whose answers hold a token the grammar masks
    assert caught <= {c.name for c in picked if MODES[c.mode].drafts}


def test_negative_control_a_transform_dropped_after_the_first_call_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The transform travels once, on the call that starts the session (prefix_len 0): a worker
    that forgets it on the calls after scores the second round untransformed. The cells that
    check two rounds catch it in every drafting mode, on every payload."""
    from workers.stage import StageSide
    from workers.step import Steps

    def forgetful(real: Any) -> Any:
        def shaping(self: Any, req: Any, *more: Any) -> Any:
            return real(self, req, *more) if req.prefix_len == 0 else None

        return shaping

    monkeypatch.setattr(Steps, "_shaping", forgetful(Steps._shaping))
    monkeypatch.setattr(StageSide, "shaping", forgetful(StageSide.shaping))
    # at T = 0 the table's argmax outlives the transform
    picked = [
        c for c in CELLS if c.rounds > 1 and c.transform and c.workers == "1 worker" and c.sampling == "T=1"
    ]
    picked = _one_each(picked, lambda c: (c.mode, c.payload, c.option))
    caught = _caught(picked)
    assert {c.name for c in picked if c.claim is Guarantee.LOSSLESS} <= caught
    assert {(c.mode, c.payload) for c in picked if c.name in caught} == {
        (c.mode, c.payload) for c in CELLS if c.transform
    }


def test_negative_control_a_residual_fill_over_masked_ids_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Top-k's residual reconstruction spreading σ over the whole vocabulary, the grammar ignored:
    a masked id can be drawn at a rejection. Caught at T = 1 (the top-k 2 and top-p samplings
    leave σ = 0)."""
    monkeypatch.setattr(round_module.Round, "allowed", lambda self: None)
    picked = [
        c for c in CELLS if c.option == "residual reconstruction" and c.transform and c.sampling == "T=1"
    ]
    assert picked and _caught(picked) == {c.name for c in picked}


def test_every_transform_is_in_the_matrix() -> None:
    """Each transform alone and all together, in every mode that serves them, on every payload."""
    for mode in MODES:
        for payload in _payloads(mode):
            assert {c.transform for c in CELLS if c.mode is mode and c.payload is payload} >= set(
                TRANSFORMS
            ), (mode, payload)


def test_workers_that_score_a_step_on_the_device_keep_every_law(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers on ``--scoring device`` (workers.device_scoring: a step's calls scored together where the
    logits are) give the cells the same laws: one cell per mode × payload × rule × shape here, with one worker
    at T = 1 and T = 0, the largest trees with SPECGATE_FULL_STATISTICS=1 (the whole matrix passes with
    SPECGATE_WORKER_SCORING=device). Their accept test draws through ``count_accepts``, which the enumeration
    sees; a comparison by hand would escape it and fail here."""
    import workers.step as step

    monkeypatch.setenv("SPECGATE_WORKER_SCORING", "device")
    used: list[int] = []
    real = step.StepScoring.launch
    monkeypatch.setattr(
        step.StepScoring, "launch", lambda self, *args: used.append(len(args[1])) or real(self, *args)
    )
    picked = [
        c
        for c in CELLS
        if c.workers == "1 worker"
        and not c.option
        and not c.overlap
        and not c.transform
        and c.sampling in ("T=1", "T=0")
        # stages score by rows (score_rows)
        and c.mode is not Mode.PIPELINE
        and (FULL or not any(big in c.shape for big in ("⟨2,1⟩", "nodes 3")))
    ]
    picked = _one_each(picked, lambda c: (c.mode, c.payload, c.rule, c.shape, c.sampling))
    # the token at a rejection drawn on the device
    picked += [
        c
        for c in CELLS
        if c.mode is Mode.SPLIT
        and c.payload is Payload.FULL
        and c.option.startswith("draft top")
        and c.sampling != "T=0"
    ]
    assert len(picked) >= 40 and used == [] and not _caught(picked) and used
