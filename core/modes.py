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


@dataclass(frozen=True)
class ModeSpec:
    mode: Mode
    fields: frozenset[str]  # the fields of ``speculative`` a request may set in this mode
    payloads: frozenset[Payload]  # what its targets may answer with (``SpecOptions.payload``)
    drafts: bool = True  # the gateway drafts (autoregressive: no)
    one_worker: bool = False  # verifies on exactly one worker (split)
    openai_logprobs: bool = False  # openai-logprobs engines may be among the targets (docs/design.md §8)
    pipelines: bool = False  # pipeline targets (stage workers, docs/design.md §3.7) may be among the targets

    @property
    def takes_k(self) -> bool:
        """Top-k payloads (``k``) exist in this mode."""
        return "k" in self.fields


MODES: dict[Mode, ModeSpec] = {
    Mode.AUTOREGRESSIVE: ModeSpec(
        Mode.AUTOREGRESSIVE,
        _EVERY,
        frozenset({Payload.SAMPLES, Payload.LOGPROBS}),
        drafts=False,
        openai_logprobs=True,
        pipelines=True,
    ),
    Mode.AGGREGATE: ModeSpec(
        Mode.AGGREGATE,
        _DRAFTING | {"k", "reconstruction", "relaxation"},
        frozenset({Payload.FULL, Payload.TOP_K, Payload.LOGPROBS}),
        openai_logprobs=True,
        pipelines=True,
    ),
    Mode.SPLIT: ModeSpec(
        Mode.SPLIT, _DRAFTING | {"k"}, frozenset({Payload.FULL, Payload.TOP_K}), one_worker=True
    ),
    Mode.EXACT: ModeSpec(Mode.EXACT, _DRAFTING | {"relaxation"}, frozenset({Payload.SPARSE})),
    Mode.TREE: ModeSpec(
        Mode.TREE,
        _EVERY | {"tree", "k", "reconstruction", "draft_top_k", "draft_top_p", "drafter"},
        frozenset({Payload.FULL, Payload.TOP_K, Payload.SPARSE}),
        pipelines=True,
    ),
    # one pipeline target, full distributions
    Mode.PIPELINE: ModeSpec(
        Mode.PIPELINE,
        _EVERY | {"pipeline", "drafter"},
        frozenset({Payload.FULL}),
        one_worker=True,
        pipelines=True,
    ),
}

SERVED_MODES = tuple(MODES)
OPENAI_LOGPROBS_MODES = tuple(m for m in SERVED_MODES if MODES[m].openai_logprobs)
PIPELINE_TARGET_MODES = tuple(m for m in SERVED_MODES if MODES[m].pipelines)


def target_problem(
    mode: Mode, num_targets: int, engines: Sequence[str], pipelines: Sequence[str]
) -> str | None:
    """Why ``mode`` cannot verify on these targets (``engines``, ``pipelines``: those among them), or None;
    checked at start-up and per request."""
    spec = MODES[mode]
    if engines and not spec.openai_logprobs:
        return (
            f"mode {mode.value!r} needs specgate workers; {engines[0]} is an openai-logprobs engine "
            f"(use {' or '.join(m.value for m in OPENAI_LOGPROBS_MODES)})"
        )
    if mode is Mode.PIPELINE and not pipelines:
        return (
            "mode 'pipeline' needs one pipeline target (workers: [{pipeline: [stage URLs]}]); these "
            "workers are whole models"
        )
    if spec.one_worker and num_targets != 1:
        return f"mode {mode.value} verifies on one worker; there are {num_targets}"
    if pipelines and not spec.pipelines:
        return (
            f"mode {mode.value!r} cannot verify on the pipeline target {pipelines[0]}: use one of "
            f"{[m.value for m in PIPELINE_TARGET_MODES]}"
        )
    return None
