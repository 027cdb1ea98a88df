"""Each decoding mode (docs/design.md §3): its ``speculative`` fields, whether the gateway drafts, its needs
of the targets; its verify: ``app.engine``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from core.names import Mode


class Payload(StrEnum):
    """What a target's answer carries for each row it scores: what a mode can promise follows from it."""

    # autoregressive: each worker's own z_n ~ T(p_n); at T = 0 a top-k whose argmax is certified
    SAMPLES = "samples"
    FULL = "full"  # the whole T(p_n) (k: full; split's p at the rejection; a pipeline's last stage)
    TOP_K = "top_k"  # the top-k of T(p_n), reconstructed at the gateway (SpecFed)
    SPARSE = "sparse"  # exact's: p_n on the draft's supports, the mass off them, one sample from off them
    LOGPROBS = "logprobs"  # an openai-logprobs engine's top-k log-probabilities (docs/design.md §8)


class Guarantee(StrEnum):
    """What a response may claim (usage ``speculative.lossless``)."""

    # the output follows the target exactly: tests/app/test_lossless_matrix.py proves each cell
    LOSSLESS = "lossless"
    # lossy, with its bound in the usage block (bias_bound_mean, relaxed_tv_mean), checked there too
    BOUNDED = "bounded"


GUARANTEES: dict[Payload, Guarantee] = {
    Payload.SAMPLES: Guarantee.LOSSLESS,
    Payload.FULL: Guarantee.LOSSLESS,
    Payload.SPARSE: Guarantee.LOSSLESS,
    Payload.TOP_K: Guarantee.BOUNDED,
    Payload.LOGPROBS: Guarantee.BOUNDED,
}


def guarantee(payload: Payload, relaxed: bool) -> Guarantee:
    """The claim of a configuration: its payload's, unless DSD's relaxed test loosens it (docs/design.md
    §3.8)."""
    return Guarantee.BOUNDED if relaxed else GUARANTEES[payload]


_EVERY = frozenset({"mode", "profile"})
_DRAFTING = _EVERY | {"num_draft_tokens", "draft_top_k", "draft_top_p", "overlap", "drafter"}


# What a worker's answer to a verify call carries, by which its scoring (workers.scoring.SCORINGS) and its
# checks (core.protocol.checks.ANSWERS) are found: T(p) rows (whole or top-k); one sample z ~ T(p); split's
# verdict (accepted, bonus, or p at the rejection); exact's sparse rows on the draft's supports
ROWS, SAMPLE, VERDICT, SPARSE = "rows", "sample", "verdict", "sparse"


@dataclass(frozen=True)
class ModeSpec:
    """A decoding mode, whole: what a request may set in it, what its targets answer with, the gateway's
    strategy that verifies it and how a worker scores its calls. ``register`` adds one (docs/design.md, "How
    to add a mode")."""

    mode: str  # a Mode, or a registered mode's name
    fields: frozenset[str]  # the fields of ``speculative`` a request may set in this mode
    payloads: frozenset[Payload]  # what its targets may answer with (``SpecOptions.payload``)
    # its strategy's name in app.engine.strategies.STRATEGIES; None: its payload's verifies it (tree)
    strategy: str | None
    # what a worker's answer to its verify call carries at T = 0 and at T > 0 (ROWS, SAMPLE, VERDICT,
    # SPARSE or a registered one); None: it makes no verify call (pipeline: /v1/stage/forward)
    scoring: tuple[str, str] | None
    drafts: bool = True  # the gateway drafts (autoregressive: no; its calls score one position)
    trees: bool = False  # its verify calls may carry a tree (protocol v1.1 ``parents``)
    one_worker: bool = False  # verifies on exactly one worker (split)
    openai_logprobs: bool = False  # openai-logprobs engines may be among the targets (docs/design.md §8)
    pipelines: bool = False  # pipeline targets (stage workers, docs/design.md §3.7) may be among the targets

    @property
    def takes_k(self) -> bool:
        """Top-k payloads (``k``) exist in this mode."""
        return "k" in self.fields


_ROWS = (ROWS, ROWS)
MODES: dict[str, ModeSpec] = {
    Mode.AUTOREGRESSIVE: ModeSpec(
        Mode.AUTOREGRESSIVE,
        _EVERY,
        frozenset({Payload.SAMPLES, Payload.LOGPROBS}),
        Mode.AUTOREGRESSIVE,
        (ROWS, SAMPLE),
        drafts=False,
        openai_logprobs=True,
        pipelines=True,
    ),
    Mode.AGGREGATE: ModeSpec(
        Mode.AGGREGATE,
        _DRAFTING | {"k", "reconstruction", "relaxation"},
        frozenset({Payload.FULL, Payload.TOP_K, Payload.LOGPROBS}),
        Mode.AGGREGATE,
        _ROWS,
        trees=True,
        openai_logprobs=True,
        pipelines=True,
    ),
    Mode.SPLIT: ModeSpec(
        Mode.SPLIT,
        _DRAFTING | {"k"},
        frozenset({Payload.FULL, Payload.TOP_K}),
        Mode.SPLIT,
        (VERDICT, VERDICT),
        one_worker=True,
    ),
    Mode.EXACT: ModeSpec(
        Mode.EXACT,
        _DRAFTING | {"relaxation"},
        frozenset({Payload.SPARSE}),
        Mode.EXACT,
        (ROWS, SPARSE),
        trees=True,
    ),
    Mode.TREE: ModeSpec(
        Mode.TREE,
        _EVERY | {"tree", "k", "reconstruction", "draft_top_k", "draft_top_p", "drafter"},
        frozenset({Payload.FULL, Payload.TOP_K, Payload.SPARSE}),
        None,
        _ROWS,
        trees=True,
        pipelines=True,
    ),
    # one pipeline target, full distributions
    Mode.PIPELINE: ModeSpec(
        Mode.PIPELINE,
        _EVERY | {"pipeline", "drafter"},
        frozenset({Payload.FULL}),
        Mode.PIPELINE,
        None,
        one_worker=True,
        pipelines=True,
    ),
}


def register(spec: ModeSpec) -> ModeSpec:
    """``spec`` served under its name: a request, the config and a worker's ``/v1/verify`` then take it. A
    name taken, or a row that contradicts itself (``problems``), is refused."""
    if not spec.mode or spec.mode in MODES:
        raise ValueError(f"a mode needs a name of its own, got {spec.mode!r}")
    if found := problems(spec):
        raise ValueError(f"mode {spec.mode!r}: " + "; ".join(found))
    MODES[spec.mode] = spec
    return spec


def problems(spec: ModeSpec) -> list[str]:
    """What in a row cannot work: a request field or a kind of answer its other settings rule out."""
    kinds = set(spec.scoring or ())
    return [
        message
        for broken, message in (
            ("mode" not in spec.fields, "its fields must hold 'mode' (a request names it)"),
            (spec.takes_k and Payload.TOP_K not in spec.payloads, "a 'k' field needs top_k payloads"),
            (SAMPLE in kinds and spec.drafts, "a sample answers one position: its calls carry no draft"),
            (VERDICT in kinds and spec.trees, "a verdict is split's on a chain: no trees"),
            (
                (spec.pipelines or spec.openai_logprobs) and not kinds <= {ROWS, SAMPLE},
                "pipelines and openai-logprobs engines answer rows or a sample only",
            ),
        )
        if broken
    ]


def mode_named(name: str) -> str:
    """The mode ``name`` names (a Mode where it is built in), or a ValueError listing the served ones."""
    if name not in MODES:
        raise ValueError(f"mode {name!r} is not available: use one of {[str(m) for m in MODES]}")
    return next(m for m in MODES if m == name)


def modes_where(flag: str) -> list[str]:
    """The served modes whose ModeSpec has ``flag`` set (``openai_logprobs``, ``pipelines``, ...)."""
    return [m for m, spec in MODES.items() if getattr(spec, flag)]


def verify_modes() -> list[str]:
    """The modes ``/v1/verify`` answers (a pipeline's calls are ``/v1/stage/forward``)."""
    return [m for m, spec in MODES.items() if spec.scoring is not None]


def scoring_of(mode: str, sampled: bool) -> str:
    """What a worker's answer to a verify call of ``mode`` carries (ROWS, SAMPLE, ...), at T > 0 if
    ``sampled``."""
    scoring = MODES[mode].scoring
    if scoring is None:
        raise ValueError(f"mode {mode} makes no verify call")
    return scoring[sampled]


def target_problem(
    mode: str, num_targets: int, engines: Sequence[str], pipelines: Sequence[str]
) -> str | None:
    """Why ``mode`` cannot verify on these targets (``engines``, ``pipelines``: those among them), or None;
    checked at start-up and per request."""
    spec = MODES[mode]
    if engines and not spec.openai_logprobs:
        return (
            f"mode {str(mode)!r} needs specgate workers; {engines[0]} is an openai-logprobs engine "
            f"(use {' or '.join(modes_where('openai_logprobs'))})"
        )
    if spec.scoring is None and not pipelines:
        return (
            f"mode {str(mode)!r} needs one pipeline target (workers: [{{pipeline: [stage URLs]}}]); these "
            "workers are whole models"
        )
    if spec.one_worker and num_targets != 1:
        return f"mode {mode} verifies on one worker; there are {num_targets}"
    if pipelines and not spec.pipelines:
        return (
            f"mode {str(mode)!r} cannot verify on the pipeline target {pipelines[0]}: use one of "
            f"{[str(m) for m in modes_where('pipelines')]}"
        )
    return None
