"""Protocol v1's messages (docs/design.md §4): every field with its meaning, unit and shape.

Paths (all under the worker's base URL):
    GET    /v1/info               -> InfoResponse        (JSON)
    POST   /v1/verify             VerifyRequest -> VerifyResponse (binary, or JSON on request)
    DELETE /v1/sessions/{id}      -> 204
    POST   /v1/stage/forward      StageRequest -> StageResponse (a pipeline stage, docs/design.md §3.7)
    POST   /v1/stage/keep         StageRequest (``keep`` only) -> StageResponse (``held``)
    GET    /health, GET /metrics
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, TypedDict, Unpack

import numpy as np

from core.errors import ProtocolError
from core.names import Mode, ProbsDtype, Reconstruction
from core.protocol.frame import Message, loads, prefix_hash

RECONSTRUCTIONS = tuple(r.value for r in Reconstruction)
MAX_LOGPROBS = 20  # top-n alternatives per position, as OpenAI's API caps them


@dataclass(frozen=True)
class InfoResponse(Message):
    """``GET /v1/info``: what a worker serves. The gateway refuses a worker whose ``tokenizer_fingerprint`` or
    ``vocab_size`` differs from the draft's."""

    protocol_version: int  # PROTOCOL_VERSION of the worker
    modes: list[str]  # Mode values this worker can verify for
    model_id: str  # what was loaded: a path, hub id or builtin name
    vocab_size: int  # |V|: rows of the LM head
    tokenizer_fingerprint: str  # sha256 of id->token bytes, merges and special tokens
    eos_ids: list[int]  # token ids that end generation
    max_context: int  # tokens one session may hold (prefix + appended + draft)
    backend: str  # Backend value
    layer_range: list[int] | None = None  # [first, end) for a pipeline stage; None = whole model
    # the whole model's decoder layers (a stage's reports it: the gateway checks the stages cover them)
    num_layers: int | None = None
    # "llguidance 1.9.1": the gateway serves grammars only where every worker's equals its own
    grammar_engine: str | None = None
    # the longest grammar source the worker compiles: the gateway refuses longer ones with a 400
    max_grammar_bytes: int | None = None
    # how a step runs: {"forward": "static" | "hf" | …, "scoring": "device" | "host"}, and a static forward's
    # CUDA graphs ("graphs", "capture_s", "graph_mb")
    step: dict[str, Any] | None = None


class SamplingFields(TypedDict, total=False):
    """A request's sampling on a call (docs/design.md §3.2, §3.9), each field as ``VerifyRequest``'s."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    transform: dict[str, Any] | None


class AskFields(TypedDict, total=False):
    """What a call asks of the workers' answers (a strategy's choice), each field as ``VerifyRequest``'s."""

    mode: str
    k: int | None
    probs_dtype: str
    reconstruction: str
    return_probs: bool
    draft_probs: np.ndarray | None
    support_ids: np.ndarray | None
    support_sizes: np.ndarray | None
    support_q: np.ndarray | None
    logprobs: int | None
    score_tokens: bool
    score_ids: np.ndarray | None
    ahead: bool


class CallFields(SamplingFields, AskFields, total=False):
    """Every field of a ``VerifyRequest`` after ``draft``, by name (``VerifyRequest.after``)."""

    seed: int
    choice: int
    worker: int
    parents: np.ndarray | None
    path: np.ndarray | None
    seeded: bool


@dataclass(frozen=True, eq=False)
class VerifyRequest(Message):
    """``POST /v1/verify``: crop the session to ``prefix_len``, append ``tokens`` then ``draft``, and answer
    for the γ+1 positions that predict ``draft`` and the bonus token, by ``mode`` (docs/design.md §3).
    Positions are absolute: the token decided at slot j has index prefix_len + num_new + j."""

    ARRAYS: ClassVar[dict[str, str]] = {
        "tokens": "ids",
        "draft": "ids",
        "draft_probs": "f64",
        "support_ids": "ids",
        "support_sizes": "i32",
        "support_q": "f64",
        "score_ids": "ids",
        "parents": "i32",
        "path": "i32",
    }
    EXTENSIONS: ClassVar[frozenset[str]] = frozenset(
        {"logprobs", "score_tokens", "min_p", "transform", "seeded", "ahead"}
    )

    session_id: str  # the gateway's id of this session (request, choice, worker)
    prefix_len: int  # tokens, ≥ 0: the agreed prefix the worker must already hold
    prefix_hash: str  # prefix_hash(agreed[:prefix_len]); "" when prefix_len == 0
    tokens: np.ndarray  # [num_new] int: agreed tokens the worker does not hold yet
    draft: np.ndarray  # [γ] int: draft tokens to score (cached too, not agreed)
    temperature: float = 1.0  # ≥ 0; 0 = greedy (distributions are then softmax(logits))
    top_k: int = 0  # ≥ 0; 0 = no top-k truncation of the target
    top_p: float = 1.0  # (0, 1]; 1 = no nucleus truncation
    k: int | None = None  # entries per position to return; None = the full distribution
    probs_dtype: str = ProbsDtype.FP32.value  # wire dtype of the returned probabilities
    # a mode /v1/verify answers (core.modes.verify_modes): what the answer carries
    mode: str = Mode.AGGREGATE.value
    # how the gateway rebuilds p̂_n from top-k: e_n depends on it
    reconstruction: str = Reconstruction.RENORMALIZE.value
    seed: int = 0  # the request's seed, 0 ≤ seed < 2**63: keys the worker's random streams
    choice: int = 0  # the choice index (of n) this session generates
    worker: int = 0  # this worker's index in the gateway's federation
    return_probs: bool = True  # autoregressive at T > 0: also send the distribution
    draft_probs: np.ndarray | None = None  # [γ] f64, split: q̂_j(x_j) of each draft token
    support_ids: np.ndarray | None = None  # [Σ_j s_j] int, exact: S_j of every draft position, concatenated
    support_sizes: np.ndarray | None = None  # [γ] i32, exact: s_j = |S_j|
    # [Σ_j s_j] f64, split (a truncated draft): q̂_j on S_j; the worker then draws the token at a rejection
    # from norm(max(0, p − q̂_j)) itself and sends no row
    support_q: np.ndarray | None = None
    # None: none; n ≥ 0: log T(p_n) of what only the worker knows (its samples; split: the draft tokens) and
    # its top-n per scored position
    logprobs: int | None = None
    # echo: also score ``tokens`` themselves (the rows predicting tokens[1:]); needs prefix_len 0
    score_tokens: bool = False
    # [m] int: answer only log T(p_n) of these ids at the one scored position (γ = 0)
    score_ids: np.ndarray | None = None
    # [γ] i32, v1.1: the draft is a tree; node i follows node parents[i] (−1 = the root, the last agreed
    # token); rows answer for the root then each node: [γ+1, …]
    parents: np.ndarray | None = None
    # [0, 1), 0 = off: after temperature, tokens below min_p × the row's largest probability are dropped
    # (vLLM's)
    min_p: float = 0.0
    # docs/design.md §3.9, sent on a call that starts the session (prefix_len 0) and kept by it: min_tokens,
    # logit_bias, penalties, grammar (core.transform.TransformSpec's wire form)
    transform: dict[str, Any] | None = None
    # [a] i32, v1.1: the accepted nodes (root to leaf) of the tree the previous call left; the worker keeps
    # them as the last a of the prefix_len agreed tokens, dropping the rest of that tree; absent after a
    # resend
    path: np.ndarray | None = None
    # the client gave the seed: the worker computes this call's logits as it would alone, whatever shares its
    # step (a GPU's static forward: a replay of its own)
    seeded: bool = False
    # autoregressive: the gateway takes this worker's token as it is (its only worker), so the worker may
    # decode it before the next call carries it (WorkerSettings.decode_ahead)
    ahead: bool = False

    def on_wire(self) -> VerifyRequest:
        """What is sent: the transform only on a call that starts the session (prefix_len 0,
        a first call or a resend from zero); the session keeps it for the calls after."""
        return self if self.transform is None or self.prefix_len == 0 else replace(self, transform=None)

    @classmethod
    def after(
        cls,
        session_id: str,
        agreed: list[int],
        tokens: list[int],
        draft: list[int],
        **fields: Unpack[CallFields],
    ) -> VerifyRequest:
        """The request that appends ``tokens`` + ``draft`` to a session holding ``agreed``."""
        return cls(
            session_id=session_id,
            prefix_len=len(agreed),
            prefix_hash=prefix_hash(agreed),
            tokens=np.asarray(tokens, dtype=np.int64),
            draft=np.asarray(draft, dtype=np.int64),
            **fields,
        )

    @property
    def new_rows(self) -> int:
        """Rows the call appends (a scheduler step's budget)."""
        return len(self.tokens) + len(self.draft)


@dataclass(frozen=True, eq=False)
class VerifyResponse(Message):
    """The worker's answer at the γ+1 scored positions, compressed as asked."""

    ARRAYS: ClassVar[dict[str, str]] = {
        "ids": "ids",
        "probs": "probs",
        "tail_mass": "f32",
        "recon_error": "f32",
        "samples": "i32",
        "support_probs": "f32",
        "complement": "f64",
        "complement_samples": "i32",
        "draft_logprobs": "f32",
        "sample_logprobs": "f32",
        "top_ids": "ids",
        "top_logprobs": "f32",
        "prompt_logprobs": "f32",
        "prompt_top_ids": "ids",
        "prompt_top_logprobs": "f32",
        "score_logprobs": "f32",
    }

    held: int  # tokens the worker holds after the call: prefix_len + num_new + γ
    probs: np.ndarray | None = None  # [γ+1, k] (with ids) or [γ+1, V] (k = full): T(p_n)
    tail_mass: np.ndarray | None = None  # [γ+1] f32: σ_n, mass outside the sent ids; 0 for full
    ids: np.ndarray | None = None  # [γ+1, k] int: token ids of ``probs``, by falling prob
    recon_error: np.ndarray | None = None  # [γ+1] f32: e_n = TV(p̂_n, p_n) for the asked reconstruction
    samples: np.ndarray | None = None  # [γ+1] i32: z_n ~ T(p_n) (autoregressive, T > 0)
    num_accepted: int = -1  # split: draft tokens the worker accepted; -1 in other modes
    # split: the bonus token when all were accepted, or (support_q sent) the token drawn at the rejection;
    # exact: z_n ~ p_n at slot γ
    bonus: int = -1
    support_probs: np.ndarray | None = None  # [Σ_j s_j] f32, exact: p_n on each S_j, as sent
    complement: np.ndarray | None = None  # [γ] f64, exact: c_n = Σ_{x∉S_j} p_n(x), summed directly
    complement_samples: np.ndarray | None = None  # [γ] i32, exact: y_n ~ p_n(· | x ∉ S_j); −1 if c_n = 0
    probs_dtype: str = ProbsDtype.FP32.value  # wire dtype of ``probs``
    # milliseconds the worker spent in its model for this call (the scheduler step's forward)
    model_ms: float = 0.0
    batch_sessions: int = 1  # calls that shared that forward (the worker's VerifyScheduler)
    # only when the request asks for ``logprobs`` (every value a natural log of T(p_n)):
    draft_logprobs: np.ndarray | None = None  # [γ] f32, split: of each draft token at its position
    # exact: [γ+1] f32, of y_n per draft position (0 where none) then z_n; split: [1], of ``bonus``
    sample_logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None  # [γ+1, n] int: the n most likely ids per scored position
    top_logprobs: np.ndarray | None = None  # [γ+1, n] f32: their log-probabilities
    # [num_new − 1] f32, score_tokens: of tokens[i+1] after tokens[..i]
    prompt_logprobs: np.ndarray | None = None
    prompt_top_ids: np.ndarray | None = None  # [num_new − 1, n] int, score_tokens: top-n there
    prompt_top_logprobs: np.ndarray | None = None  # [num_new − 1, n] f32
    score_logprobs: np.ndarray | None = None  # [m] f32, score_ids: of each asked id at the scored position


@dataclass(frozen=True, eq=False)
class StageRequest(Message):
    """``POST /v1/stage/forward``: one segment of a session through a pipeline's stages (docs/design.md §3.7),
    in ``seq`` order: ``keep``, then the new rows through the stage's layers; a stage not the last sends their
    states on to ``next[0]`` (else its ``--next``), the last answers T(p) at rows ``[score_from, num_new)`` as
    aggregate's payload."""

    ARRAYS: ClassVar[dict[str, str]] = {"tokens": "ids", "parents": "i32", "keep": "i32", "hidden": "f16"}
    EXTENSIONS: ClassVar[frozenset[str]] = frozenset({"min_p", "transform"})

    session_id: str  # the gateway's id of this session
    seq: int  # ≥ 0: the message's place in the session's stream (consecutive from 0)
    prefix_len: int  # rows the stage holds after ``keep``, before the new rows
    tokens: np.ndarray  # [t] int: the new rows' tokens (every stage keeps them: prefix checks, rebuilds)
    # [t] i32: each new row's parent row (absolute, earlier); None = a chain after the prefix
    parents: np.ndarray | None = None
    keep: np.ndarray | None = None  # [m] i32: the rows to keep first; None = all
    # [t, hidden_size]: the new rows' input states (every stage but the first)
    hidden: np.ndarray | None = None
    hidden_dtype: str = "f16"  # wire dtype of ``hidden``: f16 (2 bytes a value) or f32
    score_from: int = 0  # the last stage answers for new rows [score_from, t)
    next: list[str] | None = None  # base URLs of the stages after the receiving one, in order
    temperature: float = 1.0  # as VerifyRequest: T(p) is what the last stage answers
    top_k: int = 0
    top_p: float = 1.0
    k: int | None = None  # entries per row; None = the full distribution
    probs_dtype: str = ProbsDtype.FP32.value
    reconstruction: str = Reconstruction.RENORMALIZE.value
    min_p: float = 0.0  # as VerifyRequest, applied by the last stage
    # as VerifyRequest (docs/design.md §3.9): on the message that starts the session (prefix_len 0); the last
    # stage keeps it and transforms each scored row by its ancestors
    transform: dict[str, Any] | None = None

    def array_dtype(self, name: str, vocab_size: int) -> str:
        if name == "hidden":
            return self.hidden_dtype
        return super().array_dtype(name, vocab_size)

    @property
    def new_rows(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True, eq=False)
class StageResponse(Message):
    """The last stage's answer, passed back through the stages before it: T(p) at the scored rows (aggregate's
    payload), and what each stage spent."""

    ARRAYS: ClassVar[dict[str, str]] = {
        "probs": "probs",
        "ids": "ids",
        "tail_mass": "f32",
        "recon_error": "f32",
        "stage_ms": "f32",
        "hop_bytes": "i32",
    }

    held: int  # rows the answering stage holds after the call
    probs: np.ndarray | None = None  # [r, k] (with ids) or [r, V]: T(p) at the scored rows; None for a keep
    tail_mass: np.ndarray | None = None  # [r] f32: σ, the mass outside the sent ids
    ids: np.ndarray | None = None  # [r, k] int: the ids of ``probs``, by falling prob
    recon_error: np.ndarray | None = None  # [r] f32: TV(p̂, p) of the reconstruction asked
    probs_dtype: str = ProbsDtype.FP32.value
    # [stages] f32: milliseconds each stage spent in its model step, first stage first
    stage_ms: np.ndarray | None = None
    # [stages − 1] i32: bytes of each stage-to-stage request (the states), first hop first
    hop_bytes: np.ndarray | None = None


@dataclass(frozen=True)
class ErrorBody(Message):
    """Every error, in the OpenAI envelope: ``{"error": {...}}`` (+ ``held`` for 409)."""

    message: str  # what was wrong, for a person
    type: str  # "invalid_request_error", "session_short", "server_error", ...
    param: str | None = None  # the offending field, when one is to blame
    code: str | None = None  # machine-readable code, e.g. "session_short"
    held: int | None = None  # session_short only: agreed tokens the worker holds

    def to_json(self) -> bytes:
        # here, not at the top: tests/gpu and the device benches import this with torch alone
        # (scripts/device_check.py)
        import orjson

        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return orjson.dumps({"error": err} if self.held is None else {"error": err, "held": self.held})

    @classmethod
    def from_json(cls, body: bytes) -> ErrorBody:
        data = loads(body)
        err = data.get("error")
        if not isinstance(err, dict) or not isinstance(err.get("message"), str):
            raise ProtocolError("error body without an 'error.message'")
        return cls(
            err["message"], str(err.get("type", "")), err.get("param"), err.get("code"), data.get("held")
        )
