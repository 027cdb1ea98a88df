"""What a response reports of its rounds (docs/design.md §5): token counts, the ``speculative`` block, vLLM's
``metrics``, round profiles."""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from app.engine import RoundResult, SpecOptions
from app.engine.spec import ROUND_PARTS
from core.math.sampling import SamplingParams
from core.math.shapes import ChildRule, TreeShape
from core.modes import MODES
from core.names import Mode

_SUMS = {  # what Usage.add sums over rounds: its field ← the RoundResult field
    "forced_tokens": "drafting.forced",
    "draft_tokens": "drafted",
    "accepted_tokens": "accepted",
    "bound": "lossy.bound",
    "error": "lossy.error",
    "draft_s": "cost.draft_s",
    "verify_s": "cost.verify_s",
    "model_s": "cost.model_s",
    "busy_s": "cost.busy_s",
    "prepared": "drafting.prepared",
    "prepared_used": "drafting.prepared_used",
    "relaxed_tv": "lossy.relaxed_tv",
    "taus": "lossy.taus",
    "turns": "pipeline.turns",
    "trees": "pipeline.rounds_ended",
    "rounds_without_draft": "drafting.without_draft",
}


@dataclass
class Usage:
    """Token counts and the ``speculative`` block of one response (docs/design.md §5)."""

    spec: SpecOptions
    prompt_tokens: int
    completion_tokens: int = 0
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bound: list[float] = field(default_factory=list)
    error: list[float] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    model_s: float = 0.0
    busy_s: float = 0.0
    prepared: int = 0
    prepared_used: int = 0
    gammas: list[int] = field(default_factory=list)  # chosen by num_draft_tokens: auto
    relaxed_tv: list[float] = field(default_factory=list)
    taus: list[float] = field(default_factory=list)
    # [a]: rounds with a draft that accepted exactly a tokens
    acceptance_histogram: list[int] = field(default_factory=list)
    tree: TreeShape | None = None  # mode tree: the shape drafted
    seconds: dict[str, float] = field(default_factory=dict)  # the rounds' time by part (RoundCost.seconds)
    round_s: float = 0.0  # the rounds' time: draft + verify
    profile: list[dict[str, Any]] = field(default_factory=list)  # speculative.profile: one entry per round
    turns: int = 0  # mode pipeline: segments answered
    trees: int = 0  # mode pipeline: rounds (trees) walked to their end
    hop_bytes: list[int] = field(default_factory=list)  # mode pipeline: stage-to-stage bytes per hop
    # tokens a grammar forced: emitted by the gateway without a round (docs/design.md §3.9)
    forced_tokens: int = 0
    # rounds the targets sampled alone while a late draft prefilled (app.engine.late)
    rounds_without_draft: int = 0
    # a thinking template's answer: the tokens of its reasoning (None: no reasoning is told apart)
    reasoning_tokens: int | None = None

    def add(self, result: RoundResult) -> None:
        for mine, theirs in _SUMS.items():
            setattr(self, mine, getattr(self, mine) + attrgetter(theirs)(result))
        # forced tokens take no round (docs/design.md §3.9)
        is_round = bool(result.tokens) and not result.drafting.forced
        self.completion_tokens += len(result.tokens)
        self.rounds += is_round
        self.bytes_sent += result.traffic.sent
        self.bytes_received += result.traffic.received
        self.round_s += result.cost.draft_s + result.cost.verify_s
        for name, seconds in result.cost.seconds.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        if self.spec.profile and is_round:
            self.profile.append(round_profile(result))
        if result.drafting.gamma is not None:
            self.gammas.append(result.drafting.gamma)
        if result.drafted:  # a pipeline's expanded tree can accept more than one draft's depth
            self.acceptance_histogram += [0] * (
                max(result.drafted, result.accepted) + 1 - len(self.acceptance_histogram)
            )
            self.acceptance_histogram[result.accepted] += 1
        self.hop_bytes += [0] * (len(result.pipeline.hop_bytes) - len(self.hop_bytes))
        for hop, size in enumerate(result.pipeline.hop_bytes):
            self.hop_bytes[hop] += size

    def timing_ms(self) -> dict[str, float]:
        """Where the rounds' time (``rounds``: draft + verify) went, by part."""
        return {**_parts_ms(self.seconds, self.round_s), "rounds": _ms(self.round_s)}

    def vllm_metrics(self) -> dict[str, Any] | None:
        """vLLM's per-request ``metrics.speculative_decoding`` (what AIPerf reads); None in a mode that drafts
        nothing."""
        if not MODES[self.spec.mode].drafts:
            return None
        steps = sum(self.acceptance_histogram)
        num_spec_tokens = (
            max(self.gammas, default=self.spec.num_draft_tokens)
            if self.spec.auto_gamma
            else self.spec.num_draft_tokens
        )
        if self.tree is not None:
            num_spec_tokens = self.tree.max_depth  # tokens a round may accept
        if self.spec.pipeline is not None:  # a pipeline's tree grows as it is walked: the deepest seen
            num_spec_tokens = max(self.spec.pipeline.tree.depth, len(self.acceptance_histogram) - 1)
        # a chain carries a grammar's forced tokens on top of γ
        num_spec_tokens = max(num_spec_tokens, len(self.acceptance_histogram) - 1)
        histogram = self.acceptance_histogram + [0] * (num_spec_tokens + 1 - len(self.acceptance_histogram))
        return {
            "speculative_decoding": {
                "mean_acceptance_length": 1 + self.accepted_tokens / steps if steps else None,
                "draft_acceptance_rate": _ratio(self.accepted_tokens, self.draft_tokens),
                "acceptance_histogram": histogram,
                "num_spec_steps": steps,
                "num_accepted_draft_tokens": self.accepted_tokens,
                "num_draft_tokens": self.draft_tokens,
                "num_spec_tokens": num_spec_tokens,
            }
        }

    def to_dict(self) -> dict[str, Any]:
        spec = self.spec
        block: dict[str, Any] = {
            "mode": str(spec.mode),
            "num_draft_tokens": 0
            if not MODES[spec.mode].drafts
            else "auto"
            if spec.auto_gamma
            else spec.num_draft_tokens,
            "k": ("full" if spec.k is None else spec.k) if MODES[spec.mode].takes_k else None,
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": _ratio(self.accepted_tokens, self.draft_tokens),
            "mean_accepted_length": _ratio(self.completion_tokens, self.rounds),
            "bytes_to_workers": self.bytes_sent,
            "bytes_from_workers": self.bytes_received,
            "draft_ms": _ms(self.draft_s),
            "verify_ms": _ms(self.verify_s),
            "worker_model_ms": _ms(self.model_s),
            "worker_busy_ms": _ms(self.busy_s),
            "timing_ms": self.timing_ms(),
            "lossless": spec.is_lossless,
            "draft_top_k": spec.draft_top_k or None,
            "draft_top_p": spec.draft_top_p if spec.draft_top_p < 1 else None,
            "logprobs_source": "target" if spec.is_lossless else "reconstruction",
            "overlap": spec.overlap,
        }
        if "drafter" in MODES[spec.mode].fields:
            block["drafter"] = spec.drafter
        if MODES[spec.mode].drafts:  # the first rounds of a long prompt, while the draft prefilled
            block["rounds_without_draft"] = self.rounds_without_draft
        if spec.auto_gamma and MODES[spec.mode].drafts:  # seeded: fixed (the output depends on γ)
            block["gamma_chosen_mean"] = _mean(self.gammas, float(spec.num_draft_tokens))
            block["gamma_auto"] = bool(self.gammas)
        # a tree (mode tree or pipeline): nodes verified per round vs tokens accepted, what a tree buys
        trees = None
        if self.tree is not None:
            block["tree"] = {**tree_block(self.tree), "payload": spec.tree_payload.value}
            trees = sum(self.acceptance_histogram)
        if spec.mode is Mode.PIPELINE and spec.pipeline is not None:
            # FlowSpec: tokens per pipeline turn and per tree
            block["pipeline"] = {
                **tree_block(spec.pipeline.tree),
                "segment": spec.pipeline.segment,
                "in_flight": spec.pipeline.in_flight or None,
                "expand": spec.pipeline.expand,
                "turns": self.turns,
                "trees": self.trees,
                "alt": _ratio(self.completion_tokens, self.turns),
                "alr": _ratio(self.completion_tokens, self.trees),
                "hop_bytes": self.hop_bytes,
            }
            trees = self.trees
        if trees is not None:
            block.update(
                num_draft_tokens=None,
                nodes_per_round=_ratio(self.draft_tokens, trees),
                accepted_per_round=_ratio(self.accepted_tokens, trees),
            )
        if self.forced_tokens:
            block["forced_tokens"] = self.forced_tokens
        if spec.relaxation is not None:  # DSD's relaxed verification: lossy by exactly τ (1 − β) per position
            block["relaxation"] = {"tau_max": spec.relaxation.tau_max, "kl_scale": spec.relaxation.kl_scale}
            block["relaxed_tv_mean"] = _mean(self.relaxed_tv, 0.0)
            block["tau_mean"] = _mean(self.taus, 0.0)
        if spec.profile:
            block["profile"] = self.profile
        if spec.overlap:
            block["prepared_drafts"] = self.prepared  # drafted during a round's flight
            block["prepared_drafts_used"] = self.prepared_used  # their assumption held
        if not spec.is_lossless:
            block["reconstruction"] = spec.reconstruction.value
            block["bias_bound_mean"] = _mean(self.bound)
            block["reconstruction_error_mean"] = _mean(self.error)
        out = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "speculative": block,
        }
        if self.reasoning_tokens is not None:  # OpenAI's place for them
            out["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return out


def round_profile(result: RoundResult) -> dict[str, Any]:
    """One round of ``speculative.profile``: tokens, bytes, and its milliseconds (draft + verify) by part."""
    total = result.cost.draft_s + result.cost.verify_s
    return {
        "tokens": len(result.tokens),
        "drafted": result.drafted,
        "accepted": result.accepted,
        "calls": result.traffic.calls,
        "bytes_up": result.traffic.sent,
        "bytes_down": result.traffic.received,
        "round_ms": _ms(total),
        "parts_ms": _parts_ms(result.cost.seconds, total),
    }


def _parts_ms(seconds: dict[str, float], total_s: float) -> dict[str, float]:
    """Milliseconds by part (ROUND_PARTS); ``other``: the rest of ``total_s`` (thread hops, waits)."""
    parts = {name: _ms(seconds.get(name, 0.0)) for name in ROUND_PARTS}
    return {**parts, "other": _ms(max(total_s - sum(seconds.values()), 0.0))}


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def _mean(values: list[float] | list[int], empty: float | None = None) -> float | None:
    return sum(values) / len(values) if values else empty


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def used_tree(spec: SpecOptions, params: SamplingParams) -> TreeShape | None:
    """The tree a request drafts (mode tree: its own, else the default by temperature)."""
    if spec.mode is not Mode.TREE:
        return None
    return spec.tree or TreeShape.default(params.is_greedy)


def tree_block(shape: TreeShape) -> dict[str, Any]:
    block: dict[str, Any] = {"rule": shape.rule.value}
    if shape.rule is ChildRule.FIXED:
        block.update(nodes=shape.nodes, depth=shape.depth, top_k=shape.top_k)
    else:
        block.update(widths=list(shape.widths), nodes=shape.size)
    return block
