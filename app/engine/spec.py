"""What a request asks of the engine and what one round gives back (docs/design.md §3)."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.drafting import DraftRequest
from app.targets.channel import Traffic
from core.math.relaxed import Relaxation
from core.math.sampling import SamplingParams
from core.math.shapes import SegmentSchedule, TreeShape
from core.modes import MODES, Guarantee, Payload, guarantee
from core.names import Mode, Reconstruction
from core.protocol import SamplingFields
from core.transform import LogitsTransform, TransformSpec


@dataclass(frozen=True, kw_only=True)
class SpecOptions:
    """The speculative settings of one request (config defaults, overridden per request)."""

    mode: str  # a Mode, or a registered mode (core.modes.register)
    num_draft_tokens: int
    k: int | None  # None = full distributions
    reconstruction: Reconstruction
    draft_top_k: int = 0  # TSLT draft truncation: keep the k most likely draft tokens (0 = off)
    draft_top_p: float = 1.0  # ... or the smallest nucleus of mass ≥ draft_top_p (1 = off)
    # some targets are openai-logprobs engines: their top-k makes it lossy (docs/design.md §8)
    engine_targets: bool = False
    overlap: bool = False  # DSD: draft the next round while this one is verified (output unchanged)
    auto_gamma: bool = False  # num_draft_tokens: auto (app.adaptive); num_draft_tokens is then the seeded γ
    # DSD's relaxed accept test (lossy; aggregate and exact at T > 0; docs/design.md §3.8)
    relaxation: Relaxation | None = None
    # mode tree: the draft tree; None = the default by temperature (TreeShape.default)
    tree: TreeShape | None = None
    # mode tree: what each node's row carries — aggregate's or exact's (docs/design.md §3.6)
    tree_payload: Mode = Mode.AGGREGATE
    pipeline: SegmentSchedule | None = None  # mode pipeline: the tree and its segments; None = the defaults
    # usage lists every round: its time by part, bytes and tokens (``specgate bench overhead``)
    profile: bool = False
    # where a draft comes from: a name in app.drafting.drafters.DRAFTERS (docs/design.md §3.10)
    drafter: str = "model"

    def __post_init__(self) -> None:
        for broken, message in (
            (self.num_draft_tokens < 1, "num_draft_tokens must be ≥ 1"),
            (self.k is not None and self.k < 1, "k must be ≥ 1 or None (full)"),
            (
                self.draft_top_k < 0 or not 0 < self.draft_top_p <= 1,
                "draft_top_k must be ≥ 0 and draft_top_p in (0, 1]",
            ),
            (
                self.sparse and self.draft_top_k == 0 and self.draft_top_p == 1,
                "exact needs draft truncation (draft_top_k or draft_top_p)",
            ),
            (
                self.tree_payload not in (Mode.AGGREGATE, Mode.EXACT),
                "a tree's payload is aggregate's or exact's",
            ),
            (
                self.payload not in MODES[self.mode].payloads,
                f"mode {self.mode} does not verify {self.payload} rows",
            ),
        ):
            if broken:
                raise ValueError(message)

    @property
    def verifier(self) -> str:
        """The strategy that verifies a round (its name in app.engine.strategies.STRATEGIES): the mode's,
        or where it names none, its payload's (a tree is a draft shape)."""
        return MODES[self.mode].strategy or self.tree_payload

    @property
    def sparse(self) -> bool:
        """exact's sparse payload: mode exact, or a tree that carries it."""
        return self.mode is Mode.EXACT or (self.mode is Mode.TREE and self.tree_payload is Mode.EXACT)

    @property
    def payload(self) -> Payload:
        """What the targets answer with for each row (``core.modes``): an engine's log-probabilities, exact's
        sparse rows, the mode's one payload where it has one, else whole rows or a top-k by ``k``."""
        own = MODES[self.mode].payloads - {Payload.LOGPROBS}
        if self.engine_targets:
            return Payload.LOGPROBS
        if self.sparse:
            return Payload.SPARSE
        if len(own) == 1:
            return next(iter(own))
        return Payload.FULL if self.k is None else Payload.TOP_K

    @property
    def relaxed(self) -> bool:
        return self.relaxation is not None and self.relaxation.tau_max > 0

    @property
    def is_lossless(self) -> bool:
        """What the response claims (usage ``speculative.lossless``): the table of ``core.modes``."""
        return guarantee(self.payload, self.relaxed) is Guarantee.LOSSLESS

    @property
    def truncation(self) -> tuple[int, float]:
        return self.draft_top_k, self.draft_top_p


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    seed: int
    choice: int
    spec: SpecOptions
    top_logprobs: int | None = None  # None: no logprobs; n ≥ 0: the token's and n alternatives
    seeded: bool = False  # the client gave the seed: the output must not depend on timing
    prompt_logprobs: int | None = None  # echo with logprobs: the prompt's tokens too (n alternatives)
    ignore_eos: bool = False  # vLLM's: EOS is sampled as the target says but does not end the answer
    # vLLM's: EOS cannot be emitted before this many tokens (the target without it, renormalised)
    min_tokens: int = 0
    # docs/design.md §3.9: logit_bias, penalties, a grammar; every worker and the draft apply it
    transform: TransformSpec | None = None
    # a late draft (app.engine.late): rounds with no draft while it prefills, then seeded waits for it,
    # unseeded goes on until it is ready
    draft_after: int = 0

    def sampling_wire(self) -> SamplingFields:
        """The request's sampling on a target's call; min-p and the transform where set (docs/design.md
        §3.9)."""
        params = self.params
        out = SamplingFields(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        if params.min_p:
            out["min_p"] = params.min_p
        if self.transform is not None:
            out["transform"] = self.transform.to_wire()
        return out

    def draft(
        self,
        session_id: str,
        sequence: list[int],
        transformer: LogitsTransform | None,
        drafter: str | None = None,
    ) -> DraftRequest:
        """What the draft is asked after ``sequence`` (``drafter``: the request's, unless given)."""
        return DraftRequest(
            session_id,
            sequence,
            self.params,
            self.seed,
            self.choice,
            self.spec.truncation,
            transformer,
            self.spec.drafter if drafter is None else drafter,
            shared=not self.seeded,
        )


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float | None  # None: the prompt's first token (nothing predicts it)
    top: list[tuple[int, float]] | None


ROUND_PARTS = (  # a round's seconds, by part (usage ``timing_ms``; ``specgate bench overhead``)
    "draft_model",
    "draft_sampling",  # the draft: its runner, the rest of drafting
    # verification and bookkeeping between the calls; the bodies encoded and decoded
    "gateway_math",
    "gateway_codec",
    "link",
    "http",  # the emulated link's delays; the HTTP round trip outside the worker's handler
    # the worker's Server-Timing
    "worker_codec",
    "worker_queue",
    "worker_model",
    "worker_scoring",
    "worker_other",
)


@dataclass
class RoundCost:
    """What a round cost, in seconds."""

    draft_s: float = 0.0  # the draft took this round (waiting for it, with overlap)
    verify_s: float = 0.0  # from sending to the workers to the verdict (network included)
    model_s: float = 0.0  # the slowest worker spent in its model, per call, summed
    busy_s: float = 0.0  # every worker (every stage) spent in its model, summed: the targets' cost
    seconds: dict[str, float] = field(default_factory=dict)  # where the round's time went, by ROUND_PARTS


@dataclass
class LossyBounds:
    """What a lossy round owes the target's law, per position; empty when lossless (docs/design.md §10)."""

    bound: list[float] = field(default_factory=list)  # Σ w_n σ_n per consumed position
    error: list[float] = field(default_factory=list)  # Σ w_n e_n per consumed position
    relaxed_tv: list[float] = field(default_factory=list)  # τ_j (1 − β_j) per emitted position (relaxation)
    taus: list[float] = field(default_factory=list)  # τ_j per emitted draft position (relaxation)


@dataclass
class DraftTally:
    """How a round's draft came: prepared ahead (overlap), its γ (auto), tokens a grammar forced, or none."""

    prepared: int = 0  # 1 when the next round's draft was prepared during this round's flight
    prepared_used: int = 0  # 1 when this round's draft is one prepared during the previous round
    gamma: int | None = None  # the γ num_draft_tokens: auto chose for this round
    forced: int = 0  # tokens a grammar forced (docs/design.md §3.9): emitted with no draft and no call
    without_draft: int = 0  # 1: a round that carried no draft, the draft still prefilling (app.engine.late)


@dataclass
class PipelineTally:
    """What mode pipeline counts in a result (docs/design.md §3.7)."""

    turns: int = 0  # segments answered (pipeline turns)
    rounds_ended: int = 0  # trees whose walk ended (a recovered or bonus token drawn)
    hop_bytes: list[int] = field(default_factory=list)  # the answered segment's bytes per stage-to-stage hop


@dataclass
class RoundResult:
    """What one round emitted — its tokens, their logprobs, why the answer ends — and by concern: what it
    cost, what it owes when lossy, how its draft came, what a pipeline counts."""

    tokens: list[int]
    drafted: int
    accepted: int
    traffic: Traffic
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"; None while generating
    prompt_logprobs: list[TokenLogprob] | None = None  # echo with logprobs: the prompt's, before any round
    path: list[int] | None = None  # a tree round: the accepted nodes, root to leaf (the next call's ``path``)
    cost: RoundCost = field(default_factory=RoundCost)
    lossy: LossyBounds = field(default_factory=LossyBounds)
    drafting: DraftTally = field(default_factory=DraftTally)
    pipeline: PipelineTally = field(default_factory=PipelineTally)
