"""Worker protocol v1 (DESIGN §4): the messages between the gateway and a worker.

Paths (all under the worker's base URL):
    GET    /v1/info               -> InfoResponse        (JSON)
    POST   /v1/verify             VerifyRequest -> VerifyResponse (binary, or JSON on request)
    DELETE /v1/sessions/{id}      -> 204
    GET    /health, GET /metrics

Encodings. Every message has two: compact binary (the default) and JSON (for debugging;
the client asks for it with ``Content-Type`` / ``Accept: application/json``).

Binary frame (all integers little-endian)::

    b"SGv1"  u32 header_len  header (header_len bytes of JSON)  array bytes ...

The JSON header is ``{"fields": {...scalars...}, "arrays": [[name, dtype, shape], ...]}``;
the arrays follow in that order, C-contiguous, with no padding. dtypes: ``u16``/``u32`` for
token ids (u16 when the vocabulary fits, DESIGN §4), ``i32``, ``f16``/``f32`` for
probabilities (``f32`` wherever a mode claims to be exact).

Errors always travel as JSON in the OpenAI envelope (``ErrorBody``), whatever was asked.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, TypeVar

import numpy as np
import orjson

from core.errors import InvalidRequest, ProtocolError
from core.math.sampling import MIN_TEMPERATURE
from core.names import Mode, ProbsDtype, Reconstruction

PROTOCOL_VERSION = 1
BINARY_CONTENT_TYPE = "application/x-specgate-v1"
JSON_CONTENT_TYPE = "application/json"
MAGIC = b"SGv1"

_PREFIX = struct.Struct("<4sI")
_DTYPES: dict[str, np.dtype] = {
    "u16": np.dtype("<u2"),
    "u32": np.dtype("<u4"),
    "i32": np.dtype("<i4"),
    "f16": np.dtype("<f2"),
    "f32": np.dtype("<f4"),
}
_MAX_HEADER_BYTES = 64 * 1024
SERVED_MODES = (Mode.AGGREGATE.value, Mode.AUTOREGRESSIVE.value, Mode.SPLIT.value, Mode.EXACT.value)
RECONSTRUCTIONS = tuple(r.value for r in Reconstruction)
_MAX_NDIM = 2
MAX_LOGPROBS = 20  # top-n alternatives per position, as OpenAI's API caps them


def ids_dtype(vocab_size: int) -> str:
    """The wire dtype of token ids for a vocabulary of ``vocab_size`` entries."""
    return "u16" if vocab_size <= 1 << 16 else "u32"


def prefix_hash(tokens: list[int] | np.ndarray) -> str:
    """Hash of an agreed token prefix: sha256 of the ids as little-endian u32, 16 hex digits."""
    data = np.asarray(tokens, dtype="<u4").tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


# --------------------------------------------------------------------------- messages

M = TypeVar("M", bound="Message")


@dataclass(frozen=True)
class Message:
    """A protocol message: scalar fields plus named numpy arrays (``ARRAYS``)."""

    # name -> wire dtype for the arrays of this message; float arrays use ``probs_dtype``
    ARRAYS: ClassVar[dict[str, str]] = {}
    # scalars added after v1.0: on the wire only when set, so frames (and older peers) are as before
    EXTENSIONS: ClassVar[frozenset[str]] = frozenset()

    def array_dtype(self, name: str, vocab_size: int) -> str:
        return ids_dtype(vocab_size) if self.ARRAYS[name] == "ids" else self.ARRAYS[name]

    def scalars(self) -> dict[str, Any]:
        return {
            f.name: getattr(self, f.name) for f in fields(self)
            if f.name not in self.ARRAYS and not (f.name in self.EXTENSIONS and getattr(self, f.name) == f.default)
        }

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            name: getattr(self, name) for name in self.ARRAYS if getattr(self, name) is not None
        }


@dataclass(frozen=True)
class InfoResponse(Message):
    """``GET /v1/info``: what a worker serves. The gateway refuses a worker whose
    ``tokenizer_fingerprint`` or ``vocab_size`` differs from the draft's."""

    protocol_version: int  # PROTOCOL_VERSION of the worker
    modes: list[str]  # Mode values this worker can verify for
    model_id: str  # what was loaded: a path, hub id or builtin name
    vocab_size: int  # |V|: rows of the LM head
    tokenizer_fingerprint: str  # sha256 of id->token bytes, merges and special tokens
    eos_ids: list[int]  # token ids that end generation
    max_context: int  # tokens one session may hold (prefix + appended + draft)
    backend: str  # Backend value
    layer_range: list[int] | None = None  # [first, end) for a pipeline stage; None = whole model


@dataclass(frozen=True, eq=False)
class VerifyRequest(Message):
    """``POST /v1/verify``: append tokens to a session and score the draft.

    The worker crops the session to ``prefix_len`` (checking ``prefix_hash``), appends
    ``tokens`` then ``draft``, and answers for the γ+1 positions that predict ``draft[0..γ-1]``
    and the bonus token (DESIGN §3.1), by ``mode``:

    - ``aggregate``: T(p_n) at each position, full or top-k, with σ_n and e_n;
    - ``autoregressive`` (γ = 0): at T > 0 one token z_n ~ T(p_n) drawn from the stream
      (seed, choice, position, WORKER_SAMPLE, worker); at T = 0 the top-k of softmax(l_n)
      for the gateway's certification. ``return_probs`` adds the distribution to a sample.
    - ``split`` (DSSD): the worker runs the accept test with ``draft_probs`` and its own
      stream, and returns the number accepted and the bonus token, or T(p) at the first
      rejected position (full or top-k);
    - ``exact``: per draft position, p_n on the draft's support S_j, the complement mass
      c_n and one complement sample y_n ~ p_n(· | x ∉ S_j); and a bonus sample z_n ~ p_n.
      At T = 0 it answers like ``aggregate`` (top-k, for certification).

    Positions are absolute: the token decided at slot j has index prefix_len + num_new + j.
    """

    ARRAYS: ClassVar[dict[str, str]] = {
        "tokens": "ids", "draft": "ids", "draft_probs": "f32", "support_ids": "ids", "support_sizes": "i32", "score_ids": "ids",
        "suppress_ids": "ids",
    }
    EXTENSIONS: ClassVar[frozenset[str]] = frozenset({"logprobs", "score_tokens", "suppress_until"})

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
    mode: str = Mode.AGGREGATE.value  # "aggregate" or "autoregressive"
    reconstruction: str = Reconstruction.RENORMALIZE.value  # how the gateway rebuilds p̂_n from top-k: e_n depends on it
    seed: int = 0  # the request's seed, 0 ≤ seed < 2**63: keys the worker's random streams
    choice: int = 0  # the choice index (of n) this session generates
    worker: int = 0  # this worker's index in the gateway's federation
    return_probs: bool = True  # autoregressive at T > 0: also send the distribution
    draft_probs: np.ndarray | None = None  # [γ] f32, split: q̂_j(x_j) of each draft token
    support_ids: np.ndarray | None = None  # [Σ_j s_j] int, exact: S_j of every draft position, concatenated
    support_sizes: np.ndarray | None = None  # [γ] i32, exact: s_j = |S_j|
    logprobs: int | None = None  # None: none; n ≥ 0: log T(p_n) of what only the worker knows (its samples; split: the draft tokens) and its top-n per scored position
    score_tokens: bool = False  # echo: also score ``tokens`` themselves (the rows predicting tokens[1:]); needs prefix_len 0
    score_ids: np.ndarray | None = None  # [m] int: answer only log T(p_n) of these ids at the one scored position (γ = 0)
    suppress_ids: np.ndarray | None = None  # [e] int, min_tokens: ids (EOS) removed from T(p_n) at positions < suppress_until
    suppress_until: int = 0  # absolute position: the scored positions below it answer for T(p_n) without suppress_ids, renormalised

    @classmethod
    def after(cls, session_id: str, agreed: list[int], tokens: list[int], draft: list[int], **params: Any) -> VerifyRequest:
        """The request that appends ``tokens`` + ``draft`` to a session holding ``agreed``."""
        return cls(
            session_id=session_id,
            prefix_len=len(agreed),
            prefix_hash=prefix_hash(agreed),
            tokens=np.asarray(tokens, dtype=np.int64),
            draft=np.asarray(draft, dtype=np.int64),
            **params,
        )

    def __eq__(self, other: object) -> bool:
        return _messages_equal(self, other)


@dataclass(frozen=True, eq=False)
class VerifyResponse(Message):
    """The worker's answer at the γ+1 scored positions, compressed as asked."""

    ARRAYS: ClassVar[dict[str, str]] = {
        "ids": "ids", "probs": "probs", "tail_mass": "f32", "recon_error": "f32", "samples": "i32",
        "support_probs": "f32", "complement": "f32", "complement_samples": "i32",
        "draft_logprobs": "f32", "sample_logprobs": "f32", "top_ids": "ids", "top_logprobs": "f32",
        "prompt_logprobs": "f32", "prompt_top_ids": "ids", "prompt_top_logprobs": "f32", "score_logprobs": "f32",
        "kept_mass": "f32",
    }

    held: int  # tokens the worker holds after the call: prefix_len + num_new + γ
    probs: np.ndarray | None = None  # [γ+1, k] (with ids) or [γ+1, V] (k = full): T(p_n)
    tail_mass: np.ndarray | None = None  # [γ+1] f32: σ_n, mass outside the sent ids; 0 for full
    ids: np.ndarray | None = None  # [γ+1, k] int: token ids of ``probs``, by falling prob
    recon_error: np.ndarray | None = None  # [γ+1] f32: e_n = TV(p̂_n, p_n) for the asked reconstruction
    samples: np.ndarray | None = None  # [γ+1] i32: z_n ~ T(p_n) (autoregressive, T > 0)
    num_accepted: int = -1  # split: draft tokens the worker accepted; -1 in other modes
    bonus: int = -1  # split: the bonus token when all were accepted; exact: z_n ~ p_n at slot γ
    support_probs: np.ndarray | None = None  # [Σ_j s_j] f32, exact: p_n on each S_j, as sent
    complement: np.ndarray | None = None  # [γ] f32, exact: c_n = Σ_{x∉S_j} p_n(x), summed directly
    complement_samples: np.ndarray | None = None  # [γ] i32, exact: y_n ~ p_n(· | x ∉ S_j); −1 if c_n = 0
    probs_dtype: str = ProbsDtype.FP32.value  # wire dtype of ``probs``
    model_ms: float = 0.0  # milliseconds the worker spent in its model for this call
    # only when the request asks for ``logprobs`` (every value a natural log of T(p_n)):
    draft_logprobs: np.ndarray | None = None  # [γ] f32, split: of each draft token at its position
    sample_logprobs: np.ndarray | None = None  # exact: [γ+1] f32, of y_n per draft position (0 where none) then z_n; split: [1], of the bonus
    top_ids: np.ndarray | None = None  # [γ+1, n] int: the n most likely ids per scored position
    top_logprobs: np.ndarray | None = None  # [γ+1, n] f32: their log-probabilities
    prompt_logprobs: np.ndarray | None = None  # [num_new − 1] f32, score_tokens: of tokens[i+1] after tokens[..i]
    prompt_top_ids: np.ndarray | None = None  # [num_new − 1, n] int, score_tokens: top-n there
    prompt_top_logprobs: np.ndarray | None = None  # [num_new − 1, n] f32
    score_logprobs: np.ndarray | None = None  # [m] f32, score_ids: of each asked id at the scored position
    # only when the request has ``suppress_ids``:
    kept_mass: np.ndarray | None = None  # [γ+1] f32 (score_ids: [1]): κ_n, the mass T(p_n) kept off them (1 where not suppressed)

    def array_dtype(self, name: str, vocab_size: int) -> str:
        if name == "probs":
            return "f16" if self.probs_dtype == ProbsDtype.FP16.value else "f32"
        return super().array_dtype(name, vocab_size)

    @property
    def num_positions(self) -> int:
        present = self.probs if self.probs is not None else self.samples
        return 0 if present is None else int(present.shape[0])

    def __eq__(self, other: object) -> bool:
        return _messages_equal(self, other)


@dataclass(frozen=True)
class ErrorBody(Message):
    """Every error, in the OpenAI envelope: ``{"error": {...}}`` (+ ``held`` for 409)."""

    message: str  # what was wrong, for a person
    type: str  # "invalid_request_error", "session_short", "server_error", ...
    param: str | None = None  # the offending field, when one is to blame
    code: str | None = None  # machine-readable code, e.g. "session_short"
    held: int | None = None  # session_short only: agreed tokens the worker holds

    def to_json(self) -> bytes:
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        body: dict[str, Any] = {"error": err}
        if self.held is not None:
            body["held"] = self.held
        return orjson.dumps(body)

    @classmethod
    def from_json(cls, body: bytes) -> ErrorBody:
        data = _loads(body)
        err = data.get("error")
        if not isinstance(err, dict) or not isinstance(err.get("message"), str):
            raise ProtocolError("error body without an 'error.message'")
        return cls(
            message=err["message"],
            type=str(err.get("type", "")),
            param=err.get("param"),
            code=err.get("code"),
            held=data.get("held"),
        )


def _messages_equal(a: Message, b: object) -> bool:
    if type(a) is not type(b):
        return False
    if a.scalars() != b.scalars():  # type: ignore[attr-defined]
        return False
    for name in a.ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None):
            return False
        if x is not None and not np.array_equal(np.asarray(x), np.asarray(y)):
            return False
    return True


# --------------------------------------------------------------------------- encoding


def encode_binary(msg: Message, vocab_size: int) -> bytes:
    """The binary frame of ``msg``; ids travel as u16 or u32 by ``vocab_size``."""
    specs, chunks = [], []
    for name, arr in msg.arrays().items():
        dtype = msg.array_dtype(name, vocab_size)
        data = np.ascontiguousarray(np.asarray(arr), dtype=_DTYPES[dtype])
        specs.append([name, dtype, list(data.shape)])
        chunks.append(data.tobytes())
    header = orjson.dumps({"fields": msg.scalars(), "arrays": specs})
    return b"".join([_PREFIX.pack(MAGIC, len(header)), header, *chunks])


def encode_json(msg: Message) -> bytes:
    """The JSON form of ``msg``: scalars and arrays (as nested lists) side by side."""
    body = dict(msg.scalars())
    for name, arr in msg.arrays().items():
        body[name] = np.asarray(arr).tolist()
    return orjson.dumps(body)


def encode(msg: Message, vocab_size: int, as_json: bool = False) -> tuple[bytes, str]:
    """``(body, content_type)`` of ``msg`` in the asked encoding."""
    if as_json:
        return encode_json(msg), JSON_CONTENT_TYPE
    return encode_binary(msg, vocab_size), BINARY_CONTENT_TYPE


def decode(cls: type[M], body: bytes, content_type: str | None) -> M:
    """Parse ``body`` into ``cls``; any defect raises ProtocolError saying what it was."""
    if is_json(content_type):
        values = _loads(body)
        if not isinstance(values, dict):
            raise ProtocolError("JSON body must be an object")
        arrays = {name: values.pop(name) for name in cls.ARRAYS if name in values}
        arrays = {n: _array_from_json(n, v, cls.ARRAYS[n]) for n, v in arrays.items()}
    else:
        values, arrays = _split_binary(body)
    return _build(cls, values, arrays)


def is_json(content_type: str | None) -> bool:
    return content_type is not None and content_type.split(";")[0].strip() == JSON_CONTENT_TYPE


def _loads(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"malformed JSON: {exc}") from exc


def _split_binary(body: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    if len(body) < _PREFIX.size:
        raise ProtocolError(f"truncated body: {len(body)} bytes, a frame starts with 8")
    magic, header_len = _PREFIX.unpack_from(body)
    if magic != MAGIC:
        raise ProtocolError(f"not a protocol v1 frame (magic {magic!r})")
    end = _PREFIX.size + header_len
    if header_len > _MAX_HEADER_BYTES or end > len(body):
        raise ProtocolError(f"header length {header_len} does not fit a {len(body)}-byte body")
    header = _loads(body[_PREFIX.size : end])
    if not isinstance(header, dict) or not isinstance(header.get("fields"), dict):
        raise ProtocolError("frame header must be an object with 'fields'")
    arrays, offset = {}, end
    for spec in header.get("arrays", []):
        name, arr, offset = _read_array(body, offset, spec)
        arrays[name] = arr
    if offset != len(body):
        raise ProtocolError(f"{len(body) - offset} trailing bytes after the last array")
    return header["fields"], arrays


def _read_array(body: bytes, offset: int, spec: Any) -> tuple[str, np.ndarray, int]:
    if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[2], list)):
        raise ProtocolError(f"bad array spec {spec!r}: want [name, dtype, shape]")
    name, dtype, shape = spec
    if dtype not in _DTYPES:
        raise ProtocolError(f"array {name!r}: unknown dtype {dtype!r}", param=str(name))
    if len(shape) > _MAX_NDIM or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ProtocolError(f"array {name!r}: bad shape {shape!r}", param=str(name))
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    nbytes = count * _DTYPES[dtype].itemsize
    if offset + nbytes > len(body):
        raise ProtocolError(
            f"truncated body: array {name!r} needs {nbytes} bytes, {len(body) - offset} left",
            param=str(name),
        )
    arr = np.frombuffer(body, dtype=_DTYPES[dtype], count=count, offset=offset).reshape(shape)
    return str(name), arr, offset + nbytes


def _array_from_json(name: str, value: Any, kind: str) -> np.ndarray:
    dtype = np.int64 if kind == "ids" else np.float32
    try:
        arr = np.asarray(value, dtype=dtype)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"array {name!r}: {exc}", param=name) from exc
    if arr.ndim > _MAX_NDIM:
        raise ProtocolError(f"array {name!r}: {arr.ndim} dimensions", param=name)
    return arr


_SCALAR_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "bool": (bool,),
}


def _build(cls: type[M], values: dict[str, Any], arrays: dict[str, np.ndarray]) -> M:
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        if f.name in cls.ARRAYS:
            if f.name in arrays:
                kwargs[f.name] = arrays[f.name]
            elif _required(f):
                raise ProtocolError(f"missing array {f.name!r}", param=f.name)
        elif f.name in values:
            kwargs[f.name] = _check_scalar(f.name, values[f.name], str(f.type))
        elif _required(f):
            raise ProtocolError(f"missing field {f.name!r}", param=f.name)
    unknown = set(values) - {f.name for f in fields(cls)}
    if unknown:
        raise ProtocolError(f"unknown fields {sorted(unknown)}", param=sorted(unknown)[0])
    return cls(**kwargs)


def _required(f: Any) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def _check_scalar(name: str, value: Any, annotation: str) -> Any:
    if value is None and "None" in annotation:
        return None
    if annotation.startswith("list"):
        if not isinstance(value, list):
            raise ProtocolError(f"field {name!r} must be a list", param=name)
        return value
    base = annotation.split("|")[0].strip()
    types = _SCALAR_TYPES.get(base)
    if types is None:
        return value
    if isinstance(value, bool) and base != "bool" or not isinstance(value, types):
        raise ProtocolError(f"field {name!r} must be {base}, got {type(value).__name__}", param=name)
    number: Any = value
    return float(number) if base == "float" else value


# --------------------------------------------------------------------------- validation


def check_ids(ids: np.ndarray, vocab_size: int, name: str) -> None:
    """Raise InvalidRequest unless every id of ``ids`` lies in [0, vocab_size)."""
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise InvalidRequest(
            f"{name}: token ids must lie in [0, {vocab_size}), got {int(ids.min())}..{int(ids.max())}",
            param=name,
        )


def check_verify_request(req: VerifyRequest, vocab_size: int) -> None:
    """Range checks of a decoded VerifyRequest against a vocabulary of ``vocab_size``."""
    for name in ("tokens", "draft"):
        arr = getattr(req, name)
        if arr.ndim != 1:
            raise InvalidRequest(f"{name} must be one-dimensional", param=name)
        check_ids(arr, vocab_size, name)
    if req.prefix_len < 0:
        raise InvalidRequest(f"prefix_len must be ≥ 0, got {req.prefix_len}", param="prefix_len")
    if req.k is not None and not 0 < req.k <= vocab_size:
        raise InvalidRequest(f"k must lie in [1, {vocab_size}], got {req.k}", param="k")
    if not (req.temperature == 0 or MIN_TEMPERATURE <= req.temperature < np.inf):
        raise InvalidRequest(f"temperature must be 0 or ≥ {MIN_TEMPERATURE}", param="temperature")
    if req.top_k < 0:
        raise InvalidRequest("top_k must be ≥ 0 (0 = off)", param="top_k")
    if not 0 < req.top_p <= 1:
        raise InvalidRequest("top_p must lie in (0, 1]", param="top_p")
    if req.probs_dtype not in {d.value for d in ProbsDtype}:
        raise InvalidRequest(f"probs_dtype must be fp16 or fp32, got {req.probs_dtype!r}", param="probs_dtype")
    if req.mode not in SERVED_MODES:
        raise InvalidRequest(f"mode {req.mode!r} is not served: use one of {list(SERVED_MODES)}", param="mode")
    if req.mode == Mode.AUTOREGRESSIVE.value and req.draft.size:
        raise InvalidRequest("autoregressive scores one position: the draft must be empty", param="draft")
    if req.reconstruction not in RECONSTRUCTIONS:
        raise InvalidRequest(f"reconstruction must be one of {list(RECONSTRUCTIONS)}", param="reconstruction")
    if not 0 <= req.seed < 2**63 or req.choice < 0 or req.worker < 0:
        raise InvalidRequest("seed must lie in [0, 2**63); choice and worker must be ≥ 0", param="seed")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"logprobs must lie in [0, {MAX_LOGPROBS}]", param="logprobs")
    if req.score_tokens and req.prefix_len != 0:
        raise InvalidRequest("score_tokens scores a whole prompt: prefix_len must be 0", param="score_tokens")
    if req.score_ids is not None:
        if req.draft.size or req.score_ids.ndim != 1:
            raise InvalidRequest("score_ids scores one position: the draft must be empty", param="score_ids")
        check_ids(req.score_ids, vocab_size, "score_ids")
    if req.suppress_ids is not None:
        if req.suppress_ids.ndim != 1 or len(np.unique(req.suppress_ids)) != req.suppress_ids.size or req.suppress_ids.size >= vocab_size:
            raise InvalidRequest("suppress_ids must be distinct token ids, not the whole vocabulary", param="suppress_ids")
        check_ids(req.suppress_ids, vocab_size, "suppress_ids")
    if req.mode == Mode.SPLIT.value:
        _check_draft_probs(req)
    if req.mode == Mode.EXACT.value and req.temperature > 0:
        _check_supports(req, vocab_size)


def _check_draft_probs(req: VerifyRequest) -> None:
    probs = req.draft_probs
    if probs is None or probs.shape != req.draft.shape:
        raise InvalidRequest("split needs draft_probs, one per draft token", param="draft_probs")
    if probs.size and (not np.all(np.isfinite(probs)) or probs.min() <= 0 or probs.max() > 1 + 1e-6):
        raise InvalidRequest("draft_probs must lie in (0, 1]: each is q̂_j of a token drawn from q̂_j", param="draft_probs")


def _check_supports(req: VerifyRequest, vocab_size: int) -> None:
    ids, sizes = req.support_ids, req.support_sizes
    if ids is None or sizes is None or sizes.shape != req.draft.shape or ids.ndim != 1:
        raise InvalidRequest("exact needs support_ids and support_sizes, one support per draft token", param="support_ids")
    if sizes.size and sizes.min() < 1 or int(sizes.sum()) != ids.size:
        raise InvalidRequest("support_sizes must be ≥ 1 and add up to len(support_ids)", param="support_sizes")
    check_ids(ids, vocab_size, "support_ids")
    for j, support in enumerate(np.split(ids, np.cumsum(sizes)[:-1]) if sizes.size else []):
        if len(np.unique(support)) != len(support) or req.draft[j] not in support:
            raise InvalidRequest(f"support {j} must hold distinct ids, the draft token among them", param="support_ids")


def check_verify_response(resp: VerifyResponse, req: VerifyRequest, vocab_size: int) -> None:
    """Raise ProtocolError unless ``resp`` is a well-formed answer to ``req``."""
    gamma, sampled = len(req.draft), req.temperature > 0
    if req.suppress_ids is not None:
        _check_kept(resp.kept_mass, 1 if req.score_ids is not None else gamma + 1)
    if req.score_ids is not None:
        _check_logprobs("score_logprobs", resp.score_logprobs, (len(req.score_ids),))
        return
    _check_asked_logprobs(resp, req, vocab_size)
    if req.mode == Mode.AUTOREGRESSIVE.value and sampled:
        if resp.samples is None or resp.samples.shape != (1,):
            raise ProtocolError("samples missing or of the wrong shape, expected (1,)")
        check_ids(np.asarray(resp.samples), vocab_size, "samples")
        if req.return_probs:
            _check_probs(resp, vocab_size, 1)
    elif req.mode == Mode.SPLIT.value:
        _check_split(resp, vocab_size, gamma, greedy=not sampled)
    elif req.mode == Mode.EXACT.value and sampled:
        _check_exact(resp, req, vocab_size)
    else:
        _check_probs(resp, vocab_size, gamma + 1)


def _check_split(resp: VerifyResponse, vocab_size: int, gamma: int, greedy: bool) -> None:
    if not 0 <= resp.num_accepted <= gamma:
        raise ProtocolError(f"num_accepted {resp.num_accepted} outside [0, {gamma}]")
    if resp.num_accepted == gamma or greedy:
        check_ids(np.array([resp.bonus]), vocab_size, "bonus")
    else:
        _check_probs(resp, vocab_size, 1)


def _check_exact(resp: VerifyResponse, req: VerifyRequest, vocab_size: int) -> None:
    gamma = len(req.draft)
    size = int(np.asarray(req.support_sizes).sum()) if gamma else 0
    probs, mass, samples = resp.support_probs, resp.complement, resp.complement_samples
    if probs is None or mass is None or samples is None:
        raise ProtocolError("exact answers need support_probs, complement and complement_samples")
    if probs.shape != (size,) or mass.shape != (gamma,) or samples.shape != (gamma,):
        raise ProtocolError(f"exact arrays of shapes {probs.shape}, {mass.shape}, {samples.shape}; expected ({size},), ({gamma},), ({gamma},)")
    for name, arr in (("support_probs", probs), ("complement", mass)):
        if not np.all(np.isfinite(arr)) or arr.min(initial=0) < 0 or arr.max(initial=0) > 1 + 1e-3:
            raise ProtocolError(f"{name}: values must be finite probabilities in [0, 1]")
    if np.any((samples < 0) & (mass > 0)) or samples.max(initial=-1) >= vocab_size or samples.min(initial=-1) < -1:
        raise ProtocolError("complement_samples must be token ids, −1 only where the complement is empty")
    check_ids(np.array([resp.bonus]), vocab_size, "bonus")


def _check_probs(resp: VerifyResponse, vocab_size: int, num_positions: int) -> None:
    if resp.probs is None or resp.tail_mass is None:
        raise ProtocolError("probs and tail_mass are missing")
    probs = np.asarray(resp.probs)
    width = vocab_size if resp.ids is None else resp.ids.shape[-1]
    if probs.shape != (num_positions, width):
        raise ProtocolError(f"probs shape {probs.shape}, expected {(num_positions, width)}")
    if resp.ids is not None:
        check_ids(np.asarray(resp.ids), vocab_size, "ids")
    checked = [("probs", probs), ("tail_mass", resp.tail_mass)]
    if resp.recon_error is not None:
        checked.append(("recon_error", resp.recon_error))
    for name, arr in checked[1:]:
        if arr.shape != (num_positions,):
            raise ProtocolError(f"{name} shape {arr.shape}, expected {(num_positions,)}")
    for name, arr in checked:
        if not np.all(np.isfinite(arr)) or arr.min(initial=0) < 0 or arr.max(initial=0) > 1 + 1e-3:
            raise ProtocolError(f"{name}: values must be finite probabilities in [0, 1]")
    if not np.all(probs.sum(axis=-1) <= 1 + 1e-2):
        raise ProtocolError("probs: a position sums to more than 1")


def _check_asked_logprobs(resp: VerifyResponse, req: VerifyRequest, vocab_size: int) -> None:
    """What ``logprobs`` / ``score_tokens`` added to an answer: present, shaped, log-probabilities."""
    gamma, top = len(req.draft), req.logprobs
    if req.score_tokens:
        rows = max(len(req.tokens) - 1, 0)
        _check_logprobs("prompt_logprobs", resp.prompt_logprobs, (rows,))
        if top:
            _check_top(resp.prompt_top_ids, resp.prompt_top_logprobs, (rows, top), vocab_size, "prompt_top")
    if top is None:
        return
    if req.mode == Mode.SPLIT.value:
        _check_logprobs("draft_logprobs", resp.draft_logprobs, (gamma,))
        if resp.num_accepted == gamma or req.temperature == 0:
            _check_logprobs("sample_logprobs", resp.sample_logprobs, (1,))
    if req.mode == Mode.EXACT.value and req.temperature > 0:
        _check_logprobs("sample_logprobs", resp.sample_logprobs, (gamma + 1,))
    if top and req.mode in (Mode.SPLIT.value, Mode.EXACT.value):
        _check_top(resp.top_ids, resp.top_logprobs, (gamma + 1, top), vocab_size, "top")


def _check_kept(kept: np.ndarray | None, rows: int) -> None:
    if kept is None or kept.shape != (rows,):
        raise ProtocolError(f"kept_mass missing or of the wrong shape, expected ({rows},)")
    if not np.all(np.isfinite(kept)) or kept.min(initial=0) < 0 or kept.max(initial=0) > 1 + 1e-3:
        raise ProtocolError("kept_mass: values must be finite probabilities in [0, 1]")


def _check_logprobs(name: str, values: np.ndarray | None, shape: tuple[int, ...]) -> None:
    if values is None or values.shape != shape:
        raise ProtocolError(f"{name} missing or of the wrong shape, expected {shape}")
    if np.any(np.isnan(values)) or values.max(initial=0) > 1e-3:
        raise ProtocolError(f"{name}: values must be log-probabilities (≤ 0)")


def _check_top(ids: np.ndarray | None, values: np.ndarray | None, shape: tuple[int, int], vocab_size: int, name: str) -> None:
    if ids is None or ids.shape != shape:
        raise ProtocolError(f"{name}_ids missing or of the wrong shape, expected {shape}")
    check_ids(np.asarray(ids), vocab_size, f"{name}_ids")
    _check_logprobs(f"{name}_logprobs", values, shape)
