"""What one response reports of its rounds (DESIGN §5): the token counts and the
``speculative`` usage block, vLLM's per-request ``metrics``, and each round's profile."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.engine import RoundResult, SpecOptions
from app.engine.spec import ROUND_PARTS
from core.math.sampling import SamplingParams
from core.math.shapes import ChildRule, TreeShape
from core.modes import MODES
from core.names import Mode


@dataclass
class Usage:
    """Token counts and the ``speculative`` block of one response (DESIGN §5)."""

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
    acceptance_histogram: list[int] = field(default_factory=list)  # [a]: rounds with a draft that accepted exactly a tokens
    tree: TreeShape | None = None  # mode tree: the shape drafted
    seconds: dict[str, float] = field(default_factory=dict)  # the rounds' time by part (RoundResult.seconds)
    round_s: float = 0.0  # the rounds' time: draft + verify
    profile: list[dict[str, Any]] = field(default_factory=list)  # speculative.profile: one entry per round
    turns: int = 0  # mode pipeline: segments answered
    trees: int = 0  # mode pipeline: rounds (trees) walked to their end
    hop_bytes: list[int] = field(default_factory=list)  # mode pipeline: stage-to-stage bytes per hop
    forced_tokens: int = 0  # tokens a grammar forced: emitted by the gateway without a round (DESIGN §3.9)

    def add(self, result: RoundResult) -> None:
        self.completion_tokens += len(result.tokens)
        self.rounds += 1 if result.tokens and not result.forced else 0  # forced tokens take no round (DESIGN §3.9)
        self.forced_tokens += result.forced
        self.draft_tokens += result.drafted
        self.accepted_tokens += result.accepted
        self.bytes_sent += result.traffic.sent
        self.bytes_received += result.traffic.received
        self.bound += result.bound
        self.error += result.error
        self.draft_s += result.draft_s
        self.verify_s += result.verify_s
        self.model_s += result.model_s
        self.busy_s += result.busy_s
        self.round_s += result.draft_s + result.verify_s
        for name, seconds in result.seconds.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        if self.spec.profile and result.tokens and not result.forced:
            self.profile.append(round_profile(result))
        self.prepared += result.prepared
        self.prepared_used += result.prepared_used
        self.relaxed_tv += result.relaxed_tv
        self.taus += result.taus
        if result.gamma is not None:
            self.gammas.append(result.gamma)
        if result.drafted:
            size = max(result.drafted, result.accepted) + 1  # a pipeline's expanded tree can accept more than one draft's depth
            if len(self.acceptance_histogram) < size:
                self.acceptance_histogram += [0] * (size - len(self.acceptance_histogram))
            self.acceptance_histogram[result.accepted] += 1
        self.turns += result.turns
        self.trees += result.rounds_ended
        if result.hop_bytes:
            self.hop_bytes += [0] * (len(result.hop_bytes) - len(self.hop_bytes))
            for hop, size in enumerate(result.hop_bytes):
                self.hop_bytes[hop] += size

    def timing_ms(self) -> dict[str, float]:
        """Where the rounds' time went (ROUND_PARTS), and ``rounds``: their sum — draft + verify
        — of which ``other`` is the rest (thread hops, waits, what no part names)."""
        parts = {name: round(self.seconds.get(name, 0.0) * 1e3, 3) for name in ROUND_PARTS}
        return {**parts, "other": round(max(self.round_s - sum(self.seconds.values()), 0.0) * 1e3, 3), "rounds": round(self.round_s * 1e3, 3)}

    def vllm_metrics(self) -> dict[str, Any] | None:
        """vLLM's per-request ``metrics.speculative_decoding`` (what AIPerf reads), from the
        same counters as the ``speculative`` block; None in a mode that drafts nothing."""
        if not MODES[self.spec.mode].drafts:
            return None
        steps = sum(self.acceptance_histogram)
        num_spec_tokens = max(self.gammas, default=self.spec.num_draft_tokens) if self.spec.auto_gamma else self.spec.num_draft_tokens
        if self.tree is not None:
            num_spec_tokens = self.tree.max_depth  # tokens a round may accept
        if self.spec.pipeline is not None:  # a pipeline's tree grows as it is walked: the deepest seen
            num_spec_tokens = max(self.spec.pipeline.tree.depth, len(self.acceptance_histogram) - 1)
        num_spec_tokens = max(num_spec_tokens, len(self.acceptance_histogram) - 1)  # a chain carries a grammar's forced tokens on top of γ
        histogram = self.acceptance_histogram + [0] * (num_spec_tokens + 1 - len(self.acceptance_histogram))
        return {"speculative_decoding": {
            "mean_acceptance_length": 1 + self.accepted_tokens / steps if steps else None,
            "draft_acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
            "acceptance_histogram": histogram,
            "num_spec_steps": steps,
            "num_accepted_draft_tokens": self.accepted_tokens,
            "num_draft_tokens": self.draft_tokens,
            "num_spec_tokens": num_spec_tokens,
        }}

    def to_dict(self) -> dict[str, Any]:
        spec = self.spec
        block: dict[str, Any] = {
            "mode": spec.mode.value,
            "num_draft_tokens": 0 if not MODES[spec.mode].drafts else "auto" if spec.auto_gamma else spec.num_draft_tokens,
            "k": ("full" if spec.k is None else spec.k) if MODES[spec.mode].takes_k else None,
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
            "mean_accepted_length": self.completion_tokens / self.rounds if self.rounds else None,
            "bytes_to_workers": self.bytes_sent,
            "bytes_from_workers": self.bytes_received,
            "draft_ms": round(self.draft_s * 1e3, 3),
            "verify_ms": round(self.verify_s * 1e3, 3),
            "worker_model_ms": round(self.model_s * 1e3, 3),
            "worker_busy_ms": round(self.busy_s * 1e3, 3),
            "timing_ms": self.timing_ms(),
            "lossless": spec.is_lossless,
            "draft_top_k": spec.draft_top_k or None,
            "draft_top_p": spec.draft_top_p if spec.draft_top_p < 1 else None,
            "logprobs_source": "target" if spec.is_lossless else "reconstruction",
            "overlap": spec.overlap,
        }
        if "drafter" in MODES[spec.mode].fields:
            block["drafter"] = spec.drafter.value
        if spec.auto_gamma and MODES[spec.mode].drafts:  # seeded: fixed (the output depends on γ)
            block["gamma_chosen_mean"] = sum(self.gammas) / len(self.gammas) if self.gammas else float(spec.num_draft_tokens)
            block["gamma_auto"] = bool(self.gammas)
        if self.tree is not None:  # nodes verified per round vs tokens emitted: what a tree buys
            block["num_draft_tokens"] = None
            block["tree"] = {**tree_block(self.tree), "payload": spec.tree_payload.value}
            drafted_rounds = sum(self.acceptance_histogram)
            block["nodes_per_round"] = self.draft_tokens / drafted_rounds if drafted_rounds else None
            block["accepted_per_round"] = self.accepted_tokens / drafted_rounds if drafted_rounds else None
        if spec.mode is Mode.PIPELINE and spec.pipeline is not None:  # FlowSpec: tokens per pipeline turn and per tree
            block["num_draft_tokens"] = None
            block["pipeline"] = {
                **tree_block(spec.pipeline.tree), "segment": spec.pipeline.segment, "in_flight": spec.pipeline.in_flight or None,
                "expand": spec.pipeline.expand, "turns": self.turns, "trees": self.trees,
                "alt": self.completion_tokens / self.turns if self.turns else None,
                "alr": self.completion_tokens / self.trees if self.trees else None,
                "hop_bytes": self.hop_bytes,
            }
            block["nodes_per_round"] = self.draft_tokens / self.trees if self.trees else None
            block["accepted_per_round"] = self.accepted_tokens / self.trees if self.trees else None
        if self.forced_tokens:
            block["forced_tokens"] = self.forced_tokens
        if spec.relaxation is not None:  # DSD's relaxed verification: lossy by exactly τ (1 − β) per position
            block["relaxation"] = {"tau_max": spec.relaxation.tau_max, "kl_scale": spec.relaxation.kl_scale}
            block["relaxed_tv_mean"] = sum(self.relaxed_tv) / len(self.relaxed_tv) if self.relaxed_tv else 0.0
            block["tau_mean"] = sum(self.taus) / len(self.taus) if self.taus else 0.0
        if spec.profile:
            block["profile"] = self.profile
        if spec.overlap:
            block["prepared_drafts"] = self.prepared  # drafted during a round's flight
            block["prepared_drafts_used"] = self.prepared_used  # their assumption held
        if not spec.is_lossless:
            block["reconstruction"] = spec.reconstruction.value
            block["bias_bound_mean"] = sum(self.bound) / len(self.bound) if self.bound else None
            block["reconstruction_error_mean"] = sum(self.error) / len(self.error) if self.error else None
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "speculative": block,
        }


def round_profile(result: RoundResult) -> dict[str, Any]:
    """One round of ``speculative.profile``: tokens, bytes, and its milliseconds by part
    (ROUND_PARTS), ``other`` the rest of ``round`` (draft + verify)."""
    total = result.draft_s + result.verify_s
    parts = {name: round(result.seconds.get(name, 0.0) * 1e3, 3) for name in ROUND_PARTS}
    return {
        "tokens": len(result.tokens), "drafted": result.drafted, "accepted": result.accepted, "calls": result.traffic.calls,
        "bytes_up": result.traffic.sent, "bytes_down": result.traffic.received, "round_ms": round(total * 1e3, 3),
        "parts_ms": {**parts, "other": round(max(total - sum(result.seconds.values()), 0.0) * 1e3, 3)},
    }


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
