"""What each decoding mode is (DESIGN §3), in one place: the fields of ``speculative`` it takes,
whether the gateway drafts, what it needs of the targets. Config, the OpenAI service, the
protocol and the worker derive their lists from here; how a mode verifies is the gateway's
strategy of the same name (``app.engine``)."""

from __future__ import annotations

from dataclasses import dataclass

from core.names import Mode

_EVERY = frozenset({"mode", "profile"})
_DRAFTING = _EVERY | {"num_draft_tokens", "draft_top_k", "draft_top_p", "overlap"}


@dataclass(frozen=True)
class ModeSpec:
    mode: Mode
    fields: frozenset[str]  # the fields of ``speculative`` a request may set in this mode
    served: bool = True  # built (every mode is now)
    drafts: bool = True  # the gateway drafts (autoregressive: no)
    one_worker: bool = False  # verifies on exactly one worker (split)
    engines: bool = False  # openai-logprobs engines may be among the targets (DESIGN §8)
    pipelines: bool = False  # pipeline targets (stage workers, DESIGN §3.7) may be among the targets

    @property
    def takes_k(self) -> bool:
        """Top-k payloads (``k``) exist in this mode."""
        return "k" in self.fields


MODES: dict[Mode, ModeSpec] = {
    Mode.AUTOREGRESSIVE: ModeSpec(Mode.AUTOREGRESSIVE, _EVERY, drafts=False, engines=True, pipelines=True),
    Mode.AGGREGATE: ModeSpec(Mode.AGGREGATE, _DRAFTING | {"k", "reconstruction", "relaxation"}, engines=True, pipelines=True),
    Mode.SPLIT: ModeSpec(Mode.SPLIT, _DRAFTING | {"k"}, one_worker=True),
    Mode.EXACT: ModeSpec(Mode.EXACT, _DRAFTING | {"relaxation"}),
    Mode.TREE: ModeSpec(Mode.TREE, _EVERY | {"tree", "k", "reconstruction", "draft_top_k", "draft_top_p"}, pipelines=True),
    Mode.PIPELINE: ModeSpec(Mode.PIPELINE, _EVERY | {"pipeline"}, one_worker=True, pipelines=True),  # one pipeline target, full distributions
}

SERVED_MODES = tuple(m for m, spec in MODES.items() if spec.served)
ENGINE_MODES = tuple(m for m in SERVED_MODES if MODES[m].engines)
PIPELINE_TARGET_MODES = tuple(m for m in SERVED_MODES if MODES[m].pipelines)
