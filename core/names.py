"""The names of docs/design.md §2–3 that travel on the wire and in configuration."""

from __future__ import annotations

from enum import StrEnum


class Mode(StrEnum):
    """A decoding mode (docs/design.md §3): what goes on the wire and where verification happens."""

    AUTOREGRESSIVE = "autoregressive"
    AGGREGATE = "aggregate"
    SPLIT = "split"
    EXACT = "exact"
    TREE = "tree"
    PIPELINE = "pipeline"


class Backend(StrEnum):
    """A model runner backend (docs/design.md §7)."""

    TRANSFORMERS = "transformers"
    LLAMA_CPP = "llama.cpp"


class ProbsDtype(StrEnum):
    """How probabilities travel: fp32 wherever a mode claims to be exact."""

    FP16 = "fp16"
    FP32 = "fp32"


class Reconstruction(StrEnum):
    """How the gateway rebuilds p̂_n from a top-k payload (docs/design.md §3.3)."""

    RENORMALIZE = "renormalize"  # eq. 5: p_n / ρ_n on S_n, 0 elsewhere (the default)
    RESIDUAL = "residual"  # eq. 6: p_n on S_n, σ_n / (|V| − k) elsewhere


class TargetType(StrEnum):
    """What a target entry speaks (docs/design.md §4, §8)."""

    SPECGATE = "specgate"  # our worker: protocol v1, every mode
    # an OpenAI-compatible engine's top-k logprobs (autoregressive, aggregate)
    OPENAI_LOGPROBS = "openai-logprobs"
