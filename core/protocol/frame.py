"""Protocol v1's frame (docs/design.md §4): the binary and JSON encodings every message shares.

Binary (little-endian): ``b"SGv1"  u32 header_len  header (JSON)  array bytes ...``; the header is
``{"fields": {...}, "arrays": [[name, dtype, shape], ...]}`` (fields: only those off their defaults), the
arrays follow in that order, C-contiguous. ``f64`` carries what an exact mode needs to the last bit (in f32:
off by ~1e-8)."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, TypeVar

import numpy as np

from core.errors import ProtocolError

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
    "f64": np.dtype("<f8"),
}
_MAX_HEADER_BYTES = 64 * 1024
_MAX_NDIM = 2


def ids_dtype(vocab_size: int) -> str:
    """The wire dtype of token ids for a vocabulary of ``vocab_size`` entries."""
    return "u16" if vocab_size <= 1 << 16 else "u32"


def prefix_hash(tokens: list[int] | np.ndarray) -> str:
    """Hash of an agreed token prefix: sha256 of the ids as little-endian u32, 16 hex digits."""
    data = np.asarray(tokens, dtype="<u4").tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


M = TypeVar("M", bound="Message")


@dataclass(frozen=True, eq=False)
class Message:
    """A protocol message: scalar fields plus named numpy arrays (``ARRAYS``); equal when both are."""

    # name -> wire dtype for the arrays of this message; "ids" by the vocabulary, "probs" by ``probs_dtype``
    ARRAYS: ClassVar[dict[str, str]] = {}
    # scalars added after v1.0: on the wire only when set, so frames (and older peers) are as before
    EXTENSIONS: ClassVar[frozenset[str]] = frozenset()

    def array_dtype(self, name: str, vocab_size: int) -> str:
        kind = self.ARRAYS[name]
        if kind == "probs":
            return "f16" if getattr(self, "probs_dtype") == "fp16" else "f32"  # noqa: B009 - a subclass field
        return ids_dtype(vocab_size) if kind == "ids" else kind

    def scalars(self) -> dict[str, Any]:
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in self.ARRAYS
            and not (f.name in self.EXTENSIONS and getattr(self, f.name) == f.default)
        }

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.ARRAYS if getattr(self, name) is not None}

    def __eq__(self, other: object) -> bool:
        if type(self) is not type(other) or self.scalars() != other.scalars():  # type: ignore[attr-defined]
            return False
        pairs = [(getattr(self, name), getattr(other, name)) for name in self.ARRAYS]
        return all(
            (x is None) == (y is None) and (x is None or np.array_equal(np.asarray(x), np.asarray(y)))
            for x, y in pairs
        )


def encode_binary(msg: Message, vocab_size: int) -> bytes:
    """The binary frame of ``msg``; ids travel as u16 or u32 by ``vocab_size``."""
    specs, chunks = [], []
    for name, arr in msg.arrays().items():
        dtype = msg.array_dtype(name, vocab_size)
        data = np.ascontiguousarray(np.asarray(arr), dtype=_DTYPES[dtype])
        specs.append([name, dtype, list(data.shape)])
        chunks.append(data.tobytes())
    # here, not at the top: tests/gpu and the device benches import this with torch alone
    # (scripts/device_check.py)
    import orjson

    header = orjson.dumps({"fields": _not_default(msg.scalars(), _defaults(type(msg))), "arrays": specs})
    return b"".join([_PREFIX.pack(MAGIC, len(header)), header, *chunks])


_DEFAULTS: dict[type, dict[str, Any]] = {}  # per message class: the fields that have a default, with it


def _defaults(cls: type[Message]) -> dict[str, Any]:
    if cls not in _DEFAULTS:
        _DEFAULTS[cls] = {f.name: f.default for f in fields(cls) if f.default is not MISSING}
    return _DEFAULTS[cls]


def _not_default(values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The scalars a decoder could not fill in itself (a bool is never taken for 0 or 1)."""
    return {
        k: v
        for k, v in values.items()
        if k not in defaults or type(v) is not type(defaults[k]) or v != defaults[k]
    }


def encode_json(msg: Message) -> bytes:
    """The JSON form of ``msg``: scalars and arrays (as nested lists) side by side."""
    import orjson

    return orjson.dumps(
        {**msg.scalars(), **{name: np.asarray(arr).tolist() for name, arr in msg.arrays().items()}}
    )


def encode(msg: Message, vocab_size: int, as_json: bool = False) -> tuple[bytes, str]:
    """``(body, content_type)`` of ``msg`` in the asked encoding."""
    return (
        (encode_json(msg), JSON_CONTENT_TYPE)
        if as_json
        else (encode_binary(msg, vocab_size), BINARY_CONTENT_TYPE)
    )


def decode(cls: type[M], body: bytes, content_type: str | None) -> M:
    """Parse ``body`` into ``cls``; any defect raises ProtocolError saying what it was."""
    if is_json(content_type):
        values = loads(body)
        if not isinstance(values, dict):
            raise ProtocolError("JSON body must be an object")
        arrays = {name: values.pop(name) for name in cls.ARRAYS if name in values}
        arrays = {n: _array_from_json(n, v, cls.ARRAYS[n]) for n, v in arrays.items()}
    else:
        values, arrays = _split_binary(body)
    return _build(cls, values, arrays)


def is_json(content_type: str | None) -> bool:
    return content_type is not None and content_type.split(";")[0].strip() == JSON_CONTENT_TYPE


def loads(body: bytes) -> Any:
    import orjson

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
    header = loads(body[_PREFIX.size : end])
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
            f"truncated body: array {name!r} needs {nbytes} bytes, {len(body) - offset} left", param=str(name)
        )
    arr = np.frombuffer(body, dtype=_DTYPES[dtype], count=count, offset=offset).reshape(shape)
    return str(name), arr, offset + nbytes


def _array_from_json(name: str, value: Any, kind: str) -> np.ndarray:
    dtype = np.int64 if kind == "ids" else np.float64 if kind == "f64" else np.float32
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
        is_array = f.name in cls.ARRAYS
        if f.name in (arrays if is_array else values):
            kwargs[f.name] = (
                arrays[f.name] if is_array else _check_scalar(f.name, values[f.name], str(f.type))
            )
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ProtocolError(f"missing {'array' if is_array else 'field'} {f.name!r}", param=f.name)
    unknown = set(values) - {f.name for f in fields(cls)}
    if unknown:
        raise ProtocolError(f"unknown fields {sorted(unknown)}", param=sorted(unknown)[0])
    return cls(**kwargs)


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
