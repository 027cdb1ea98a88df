"""Protocol v1: every message round-trips in both encodings; every defect is a ProtocolError."""

from __future__ import annotations

import struct
from dataclasses import replace

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from core.errors import InvalidRequest, ProtocolError
from core.protocol import (
    BINARY_CONTENT_TYPE,
    JSON_CONTENT_TYPE,
    ErrorBody,
    InfoResponse,
    VerifyRequest,
    VerifyResponse,
    check_verify_request,
    check_verify_response,
    decode,
    encode,
    encode_binary,
    prefix_hash,
)
from core.protocol.messages import CallFields
from core.transform import TransformSpec

VOCAB_SMALL, VOCAB_LARGE = 49152, 100_000

ids_1d = hnp.arrays(np.int64, st.integers(0, 12), elements=st.integers(0, VOCAB_SMALL - 1))
floats01 = st.floats(0, 1, width=32)


@st.composite
def verify_requests(draw: st.DrawFn) -> VerifyRequest:
    return VerifyRequest(
        session_id=draw(st.text(min_size=1, max_size=40)),
        prefix_len=draw(st.integers(0, 10_000)),
        prefix_hash=draw(st.text(alphabet="0123456789abcdef", max_size=16)),
        tokens=draw(ids_1d),
        draft=draw(ids_1d),
        temperature=draw(st.floats(0, 4)),
        top_k=draw(st.integers(0, 100)),
        top_p=draw(st.floats(0.01, 1)),
        k=draw(st.none() | st.integers(1, 64)),
        probs_dtype=draw(st.sampled_from(["fp16", "fp32"])),
        mode=draw(st.sampled_from(["aggregate", "autoregressive"])),
        reconstruction=draw(st.sampled_from(["renormalize", "residual"])),
        seed=draw(st.integers(0, 2**63 - 1)),
        choice=draw(st.integers(0, 16)),
        worker=draw(st.integers(0, 16)),
        return_probs=draw(st.booleans()),
        path=draw(st.none() | hnp.arrays(np.int32, st.integers(1, 4), elements=st.integers(0, 62))),
    )


@st.composite
def verify_responses(draw: st.DrawFn) -> VerifyResponse:
    m = draw(st.integers(1, 6))
    width = draw(st.integers(1, 16))
    dtype = draw(st.sampled_from(["fp16", "fp32"]))
    full = draw(st.booleans())
    probs = draw(hnp.arrays(np.float32, (m, width), elements=floats01))
    if dtype == "fp16":
        probs = probs.astype(np.float16).astype(np.float32)  # what survives the wire
    ids = None if full else draw(hnp.arrays(np.int64, (m, width), elements=st.integers(0, VOCAB_SMALL - 1)))
    per_position = hnp.arrays(np.float32, (m,), elements=floats01)
    samples = hnp.arrays(np.int32, (m,), elements=st.integers(0, VOCAB_SMALL - 1))
    return VerifyResponse(
        held=draw(st.integers(0, 10_000)),
        probs=draw(st.none() | st.just(probs)),
        tail_mass=draw(st.none() | per_position),
        ids=ids,
        recon_error=draw(st.none() | per_position),
        samples=draw(st.none() | samples),
        probs_dtype=dtype,
        model_ms=draw(st.floats(0, 1e4)),
    )


infos = st.builds(
    InfoResponse,
    protocol_version=st.just(1),
    modes=st.lists(st.sampled_from(["aggregate", "split", "exact"]), max_size=3),
    model_id=st.text(max_size=30),
    vocab_size=st.integers(1, 200_000),
    tokenizer_fingerprint=st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
    eos_ids=st.lists(st.integers(0, 49151), max_size=3),
    max_context=st.integers(1, 1 << 20),
    backend=st.sampled_from(["transformers", "llama.cpp"]),
    layer_range=st.none() | st.tuples(st.integers(0, 10), st.integers(10, 30)).map(list),
)

errors = st.builds(
    ErrorBody,
    message=st.text(max_size=50),
    type=st.sampled_from(["invalid_request_error", "session_short", "server_error"]),
    param=st.none() | st.text(max_size=10),
    code=st.none() | st.text(max_size=10),
    held=st.none() | st.integers(0, 5000),
)


@pytest.mark.parametrize("as_json", [False, True])
@given(msg=verify_requests())
def test_verify_request_round_trips(msg: VerifyRequest, as_json: bool) -> None:
    body, content_type = encode(msg, VOCAB_SMALL, as_json=as_json)
    assert decode(VerifyRequest, body, content_type) == msg


@pytest.mark.parametrize("as_json", [False, True])
@given(msg=verify_responses())
def test_verify_response_round_trips(msg: VerifyResponse, as_json: bool) -> None:
    body, content_type = encode(msg, VOCAB_SMALL, as_json=as_json)
    assert decode(VerifyResponse, body, content_type) == msg


@pytest.mark.parametrize("as_json", [False, True])
@given(msg=infos)
def test_info_round_trips(msg: InfoResponse, as_json: bool) -> None:
    body, content_type = encode(msg, VOCAB_SMALL, as_json=as_json)
    assert decode(InfoResponse, body, content_type) == msg


@given(msg=errors)
def test_error_body_round_trips(msg: ErrorBody) -> None:
    assert ErrorBody.from_json(msg.to_json()) == msg
    assert "error" in orjson.loads(msg.to_json())


def test_ids_travel_as_u16_or_u32_by_vocab_size() -> None:
    req = VerifyRequest("s", 0, "", tokens=np.array([1, 2, 3]), draft=np.array([4]))
    small, large = encode_binary(req, VOCAB_SMALL), encode_binary(req, VOCAB_LARGE)
    assert len(large) - len(small) == 4 * 2  # 4 ids, 2 more bytes each
    assert b'"u16"' in small and b'"u32"' in large


def test_fp16_probs_halve_the_payload() -> None:
    probs = np.full((5, 32), 0.01, dtype=np.float32)
    ids = np.zeros((5, 32), dtype=np.int64)
    tail = np.zeros(5, dtype=np.float32)
    fp32 = encode_binary(VerifyResponse(1, probs, tail, ids, probs_dtype="fp32"), VOCAB_SMALL)
    fp16 = encode_binary(VerifyResponse(1, probs, tail, ids, probs_dtype="fp16"), VOCAB_SMALL)
    assert _arrays_bytes(fp32) - _arrays_bytes(fp16) == 5 * 32 * 2


def _arrays_bytes(body: bytes) -> int:
    """A frame's bytes after its header."""
    return len(body) - 8 - int.from_bytes(body[4:8], "little")


def test_the_header_carries_only_what_differs_from_the_defaults() -> None:
    """A 4-byte answer does not travel with every default spelled out; decoding fills them in."""
    resp = VerifyResponse(held=51, samples=np.array([5], dtype=np.int32), model_ms=7.5)
    body = encode_binary(resp, VOCAB_SMALL)
    header = orjson.loads(body[8 : len(body) - 4])
    assert header["fields"] == {"held": 51, "model_ms": 7.5} and len(body) < 100
    assert decode(VerifyResponse, body, BINARY_CONTENT_TYPE) == resp
    req = VerifyRequest.after(
        "s", [1, 2], [3], [], temperature=1.0, mode="autoregressive", return_probs=False
    )
    fields = orjson.loads(encode_binary(req, VOCAB_SMALL)[8:-2])["fields"]
    # temperature 1.0 is the default
    assert set(fields) == {"session_id", "prefix_len", "prefix_hash", "mode", "return_probs"}


def test_verify_request_after_names_every_field_after_the_draft() -> None:
    """``VerifyRequest.after``'s typed keywords (``CallFields``) are the message's own fields, none missed."""
    names = list(VerifyRequest.__dataclass_fields__)
    assert set(CallFields.__annotations__) == set(names[names.index("draft") + 1 :])


def _request_body() -> bytes:
    req = VerifyRequest("s", 0, "", tokens=np.array([1, 2, 3]), draft=np.array([4, 5]))
    return encode_binary(req, VOCAB_SMALL)


@pytest.mark.parametrize(
    "body, message",
    [
        (b"", "truncated"),
        (b"SGv1", "truncated"),
        (b"XXXX" + struct.pack("<I", 2) + b"{}", "magic"),
        (b"SGv1" + struct.pack("<I", 999) + b"{}", "does not fit"),
        (b"SGv1" + struct.pack("<I", 5) + b"nope!", "malformed JSON"),
        (_request_body()[:-3], "truncated"),
        (_request_body() + b"\x00", "trailing"),
    ],
)
def test_broken_binary_bodies_are_protocol_errors(body: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode(VerifyRequest, body, BINARY_CONTENT_TYPE)


@pytest.mark.parametrize(
    "body, message",
    [
        (b"{not json", "malformed JSON"),
        (b"[1, 2]", "must be an object"),
        (b'{"session_id": "s"}', "missing field"),
        (
            b'{"session_id": "s", "prefix_len": "3", "prefix_hash": "", "tokens": [1], "draft": []}',
            "must be int",
        ),
        (
            b'{"session_id": "s", "prefix_len": 0, "prefix_hash": "", "tokens": [[[1]]], "draft": []}',
            "dimensions",
        ),
        (b'{"session_id": "s", "prefix_len": 0, "prefix_hash": "", "tokens": ["a"], "draft": []}', "tokens"),
        (
            b'{"session_id": "s", "prefix_len": 0, "prefix_hash": "", "tokens": [1], "draft": [], "x": 1}',
            "unknown fields",
        ),
    ],
)
def test_broken_json_bodies_are_protocol_errors(body: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode(VerifyRequest, body, JSON_CONTENT_TYPE)


def _req(**overrides: object) -> VerifyRequest:
    fields = dict(session_id="s", prefix_len=0, prefix_hash="", tokens=np.array([1, 2]), draft=np.array([3]))
    fields.update(overrides)
    return VerifyRequest(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "overrides, param",
    [
        ({"tokens": np.array([VOCAB_SMALL])}, "tokens"),
        ({"draft": np.array([-1])}, "draft"),
        ({"prefix_len": -1}, "prefix_len"),
        ({"k": 0}, "k"),
        ({"k": VOCAB_SMALL + 1}, "k"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"probs_dtype": "bf16"}, "probs_dtype"),
        ({"mode": "pipeline"}, "mode"),
        ({"parents": np.array([0], np.int32)}, "parents"),
        ({"parents": np.array([-1, -1], np.int32)}, "parents"),
        (
            {
                "mode": "split",
                "parents": np.array([-1], np.int32),
                "draft_probs": np.array([0.5], np.float32),
            },
            "parents",
        ),
        ({"prefix_len": 5, "path": np.array([], np.int32)}, "path"),
        ({"prefix_len": 5, "path": np.array([-1], np.int32)}, "path"),
        ({"prefix_len": 5, "path": np.array([2, 1], np.int32)}, "path"),  # a child before its parent
        ({"prefix_len": 5, "path": np.array([0, 0], np.int32)}, "path"),
        ({"prefix_len": 1, "path": np.array([0, 1], np.int32)}, "path"),  # longer than the prefix it ends
        ({"prefix_len": 99, "path": np.arange(64, dtype=np.int32)}, "path"),
        ({"mode": "autoregressive"}, "draft"),
        ({"reconstruction": "guess"}, "reconstruction"),
        ({"seed": -1}, "seed"),
        ({"mode": "split"}, "draft_probs"),
        ({"mode": "split", "draft_probs": np.array([0.0], np.float32)}, "draft_probs"),
        # q̂ without its supports
        ({"mode": "split", "draft_probs": np.array([0.5]), "support_q": np.array([0.5])}, "support_ids"),
        (
            {
                "mode": "split",
                "draft_probs": np.array([0.5]),
                "support_ids": np.array([3, 4]),
                "support_sizes": np.array([2], np.int32),
                "support_q": np.array([0.5]),
            },
            "support_q",
        ),
        (
            {
                "mode": "split",
                "draft_probs": np.array([0.5]),
                "support_ids": np.array([3, 4]),
                "support_sizes": np.array([2], np.int32),
                "support_q": np.array([0.5, 0.0]),
            },
            "support_q",
        ),
        (
            {
                "mode": "split",
                "draft_probs": np.array([0.5]),
                "support_ids": np.array([4, 5]),
                "support_sizes": np.array([2], np.int32),
                "support_q": np.array([0.5, 0.5]),
            },
            "support_ids",
        ),
        # aggregate takes none
        (
            {
                "support_ids": np.array([3]),
                "support_sizes": np.array([1], np.int32),
                "support_q": np.array([1.0]),
            },
            "support_q",
        ),
        ({"mode": "exact"}, "support_ids"),
        (
            {"mode": "exact", "support_ids": np.array([4, 5]), "support_sizes": np.array([2], np.int32)},
            "support_ids",
        ),
        (
            {"mode": "exact", "support_ids": np.array([3, 3]), "support_sizes": np.array([2], np.int32)},
            "support_ids",
        ),
        (
            {"mode": "exact", "support_ids": np.array([3]), "support_sizes": np.array([2], np.int32)},
            "support_sizes",
        ),
    ],
)
def test_out_of_range_requests_name_the_field(overrides: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_verify_request(_req(**overrides), VOCAB_SMALL)
    assert info.value.param == param


def test_response_check_rejects_garbage() -> None:
    two = VerifyRequest.after("s", [], [1], [2], temperature=0.0)  # aggregate, 2 positions
    three = VerifyRequest.after("s", [], [1], [2, 3])
    good = VerifyResponse(
        1, np.full((2, 2), 0.5, np.float32), np.zeros(2, np.float32), np.array([[0, 1], [2, 3]])
    )
    check_verify_response(good, two, VOCAB_SMALL)
    for bad in (
        VerifyResponse(1, np.full((2, 2), np.nan, np.float32), np.zeros(2, np.float32), good.ids),
        VerifyResponse(1, np.full((2, 2), -0.1, np.float32), np.zeros(2, np.float32), good.ids),
        VerifyResponse(1, np.full((2, 2), 0.9, np.float32), np.zeros(2, np.float32), good.ids),
        VerifyResponse(1, good.probs, np.zeros(2, np.float32), np.array([[0, VOCAB_SMALL], [2, 3]])),
        VerifyResponse(1, good.probs, np.zeros(3, np.float32), good.ids),
        VerifyResponse(1, None, None),
    ):
        with pytest.raises(ProtocolError):
            check_verify_response(bad, two, VOCAB_SMALL)
    with pytest.raises(ProtocolError, match="shape"):
        check_verify_response(good, three, VOCAB_SMALL)


def test_sample_check() -> None:
    req = VerifyRequest.after("s", [], [1], [], mode="autoregressive", return_probs=False)
    check_verify_response(VerifyResponse(1, samples=np.array([7], np.int32)), req, VOCAB_SMALL)
    for samples in (
        None,
        np.array([VOCAB_SMALL], np.int32),
        np.array([-1], np.int32),
        np.array([1, 2], np.int32),
    ):
        with pytest.raises(ProtocolError):
            check_verify_response(VerifyResponse(1, samples=samples), req, VOCAB_SMALL)


def test_split_and_exact_checks() -> None:
    split = VerifyRequest.after(
        "s", [], [1], [2, 3], mode="split", draft_probs=np.array([0.5, 0.5], np.float32)
    )
    check_verify_response(VerifyResponse(3, num_accepted=2, bonus=9), split, VOCAB_SMALL)
    check_verify_response(
        VerifyResponse(
            3,
            probs=np.full((1, 2), 0.5, np.float32),
            tail_mass=np.zeros(1, np.float32),
            ids=np.array([[4, 5]]),
            num_accepted=1,
        ),
        split,
        VOCAB_SMALL,
    )
    for bad in (
        VerifyResponse(3, num_accepted=3),
        VerifyResponse(3, num_accepted=2, bonus=VOCAB_SMALL),
        VerifyResponse(3, num_accepted=0),
    ):
        with pytest.raises(ProtocolError):
            check_verify_response(bad, split, VOCAB_SMALL)
    drawn = replace(
        split,
        support_ids=np.array([2, 4, 3]),
        support_sizes=np.array([2, 1], np.int32),
        support_q=np.array([0.5, 0.5, 1.0]),
    )
    check_verify_request(drawn, VOCAB_SMALL)
    # the token drawn at the rejection, no row
    check_verify_response(VerifyResponse(3, num_accepted=1, bonus=7), drawn, VOCAB_SMALL)
    with pytest.raises(ProtocolError):
        check_verify_response(VerifyResponse(3, num_accepted=1), drawn, VOCAB_SMALL)
    for as_json in (False, True):
        body, content_type = encode(drawn, VOCAB_SMALL, as_json=as_json)
        assert decode(VerifyRequest, body, content_type) == drawn
    exact = VerifyRequest.after(
        "s", [], [1], [2], mode="exact", support_ids=np.array([2, 4]), support_sizes=np.array([2], np.int32)
    )
    good = VerifyResponse(
        3,
        support_probs=np.array([0.3, 0.2], np.float32),
        complement=np.array([0.5], np.float32),
        complement_samples=np.array([7], np.int32),
        bonus=1,
    )
    check_verify_response(good, exact, VOCAB_SMALL)
    for bad in (
        replace(good, support_probs=np.array([0.3], np.float32)),
        replace(good, complement_samples=np.array([-1], np.int32)),
        replace(good, bonus=-1),
        replace(good, complement=np.array([np.inf], np.float32)),
    ):
        with pytest.raises(ProtocolError):
            check_verify_response(bad, exact, VOCAB_SMALL)


def test_min_tokens_travels_in_the_transform() -> None:
    """Issue 46: min_tokens is the transform's first step (vLLM's order), sent with it on the call
    that starts the session; no field of its own on the wire."""
    spec = TransformSpec(prompt_len=1, min_tokens=3, eos_ids=(0, 7))
    req = VerifyRequest.after("s", [], [1], [2], temperature=1.0, transform=spec.to_wire())
    for as_json in (False, True):
        body, content_type = encode(req, VOCAB_SMALL, as_json)
        assert TransformSpec.from_wire(decode(VerifyRequest, body, content_type).transform) == spec
    assert "suppress_ids" not in VerifyRequest.ARRAYS and "kept_mass" not in VerifyResponse.ARRAYS


@settings(max_examples=50)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=50))
def test_prefix_hash_is_stable_and_prefix_sensitive(tokens: list[int]) -> None:
    assert prefix_hash(tokens) == prefix_hash(np.array(tokens, dtype=np.uint32))
    assert len(prefix_hash(tokens)) == 16
    if tokens:
        assert prefix_hash(tokens) != prefix_hash(tokens[:-1])
