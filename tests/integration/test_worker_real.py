"""A real uvicorn worker per backend on the built-in model, over real HTTP on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch

from clients.procs import WorkerProcess
from core.protocol import InfoResponse, VerifyRequest, VerifyResponse, decode, encode, prefix_hash
from core.runners import ModelRunner, load_runner

pytestmark = pytest.mark.integration

TEXT = "Speculative decoding lets a small model draft tokens that a large model verifies in one pass."


@pytest.fixture(scope="module", params=["llama.cpp", "transformers"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def worker_url(backend: str) -> Iterator[str]:
    with WorkerProcess("builtin", backend, timeout_s=300, extra=("--drain-timeout-s", "0")) as url:
        # it holds the tests' sessions: no drain at the end
        yield url


@pytest.fixture(scope="module")
def in_process(backend: str, builtin_llama_shared: ModelRunner) -> ModelRunner:
    return builtin_llama_shared if backend == "llama.cpp" else load_runner("builtin", "transformers")


def _post(url: str, req: VerifyRequest) -> VerifyResponse:
    body, content_type = encode(req, 49152)
    resp = httpx.post(f"{url}/v1/verify", content=body, headers={"content-type": content_type}, timeout=60)
    assert resp.status_code == 200, resp.text
    return decode(VerifyResponse, resp.content, resp.headers["content-type"])


def test_info_reports_the_builtin_vocabulary(worker_url: str, backend: str, in_process: ModelRunner) -> None:
    resp = httpx.get(f"{worker_url}/v1/info", timeout=10)
    info = decode(InfoResponse, resp.content, resp.headers["content-type"])
    assert info.vocab_size == 49152 and info.backend == backend and info.model_id == "builtin"
    assert info.tokenizer_fingerprint == in_process.fingerprint


def test_verify_scores_agree_with_an_in_process_forward(worker_url: str, in_process: ModelRunner) -> None:
    tokens = list(in_process.tokenizer.encode(TEXT))
    prompt, draft = tokens[:-4], tokens[-4:]
    req = VerifyRequest("it", 0, prefix_hash([]), np.array(prompt), np.array(draft))
    resp = _post(worker_url, req)
    expected = torch.softmax(in_process.forward_full(tokens, 5), dim=-1).numpy()
    assert np.abs(resp.probs - expected).max() <= 1e-4
    # next round: two draft tokens accepted, one recovered token, a new draft
    agreed = prompt + draft[:2]
    req = VerifyRequest("it", len(agreed), prefix_hash(agreed), np.array([13]), np.array([42, 7]), k=32)
    resp = _post(worker_url, req)
    expected = torch.softmax(in_process.forward_full(agreed + [13, 42, 7], 3), dim=-1)
    top = torch.topk(expected, 32, dim=-1)
    assert resp.ids is not None and resp.held == len(agreed) + 3
    assert np.abs(resp.probs - top.values.numpy()).max() <= 1e-4
    np.testing.assert_allclose(resp.tail_mass, 1 - top.values.sum(-1).numpy(), atol=1e-4)
    assert httpx.delete(f"{worker_url}/v1/sessions/it", timeout=10).status_code == 204


# a tree under the root: (token, parent), parent −1 = the root (the last agreed token)
TREE = [(504, -1), (3458, -1), (28, 0), (638, 0), (359, 1), (346, 2)]


def test_a_tree_is_scored_in_one_call_like_each_path(
    worker_url: str, backend: str, in_process: ModelRunner
) -> None:
    """Protocol v1.1: ``parents`` make the draft a tree; a row for the root and one per node,
    each the target after its own path (llama.cpp bit for bit, transformers within 1e-4)."""
    prompt = list(in_process.tokenizer.encode(TEXT))
    tokens, parents = [t for t, _ in TREE], np.array([p for _, p in TREE], dtype=np.int32)
    req = VerifyRequest("tree", 0, prefix_hash([]), np.array(prompt), np.array(tokens), parents=parents)
    resp = _post(worker_url, req)
    assert resp.probs is not None and resp.probs.shape == (len(TREE) + 1, 49152)
    for row in range(len(TREE) + 1):
        path, node = [], row - 1
        while node >= 0:
            path.insert(0, TREE[node][0])
            node = TREE[node][1]
        expected = torch.softmax(in_process.forward_full(prompt + path, 1), dim=-1)[0].numpy()
        tolerance = 0.0 if backend == "llama.cpp" else 1e-4
        assert np.abs(resp.probs[row] - expected).max() <= tolerance, row
    # the next call agrees on the root's first child and its first child: the worker crops the tree
    agreed = prompt + [504, 28]
    again = _post(
        worker_url,
        VerifyRequest("tree", len(prompt), prefix_hash(prompt), np.array([504, 28]), np.array([7])),
    )
    expected = torch.softmax(in_process.forward_full(agreed + [7], 2), dim=-1).numpy()
    assert again.held == len(agreed) + 1 and np.abs(again.probs - expected).max() <= (
        0.0 if backend == "llama.cpp" else 1e-4
    )
    assert httpx.delete(f"{worker_url}/v1/sessions/tree", timeout=10).status_code == 204


@pytest.mark.parametrize("path", [[0, 2, 5], [1, 4]], ids=["first-children", "second-root-child"])
def test_the_next_call_keeps_the_accepted_path_as_a_plain_sequence(
    worker_url: str,
    backend: str,
    in_process: ModelRunner,
    path: list[int],
) -> None:
    """v1.1 ``path``: the worker keeps the accepted nodes (llama.cpp keeps the cells in place and
    decodes the others again) and scores on as after a plain sequence — bit for bit on llama.cpp."""
    prompt = list(in_process.tokenizer.encode(TEXT))
    tokens, parents = [t for t, _ in TREE], np.array([p for _, p in TREE], dtype=np.int32)
    session = f"path-{path[0]}"
    _post(
        worker_url,
        VerifyRequest(session, 0, prefix_hash([]), np.array(prompt), np.array(tokens), parents=parents),
    )
    agreed = prompt + [TREE[n][0] for n in path]
    req = VerifyRequest(
        session,
        len(agreed),
        prefix_hash(agreed),
        np.array([13]),
        np.array([42, 7]),
        path=np.array(path, dtype=np.int32),
    )
    resp = _post(worker_url, req)
    expected = torch.softmax(in_process.forward_full(agreed + [13, 42, 7], 3), dim=-1).numpy()
    assert resp.held == len(agreed) + 3 and np.abs(resp.probs - expected).max() <= (
        0.0 if backend == "llama.cpp" else 1e-4
    )
    # the rows after ``agreed`` read 13, 42, 7: a path to 5 is not there (409: resend)
    other = agreed + [13, 5]
    wrong = VerifyRequest(
        session,
        len(other),
        prefix_hash(other),
        np.array([9]),
        np.array([]),
        path=np.array([0, 1], dtype=np.int32),
    )
    body, content_type = encode(wrong, 49152)
    assert (
        httpx.post(
            f"{worker_url}/v1/verify", content=body, headers={"content-type": content_type}, timeout=60
        ).status_code
        == 409
    )
    assert httpx.delete(f"{worker_url}/v1/sessions/{session}", timeout=10).status_code == 204


@pytest.mark.parametrize(
    "parents, draft, field",
    [
        ([-1, 2, 0], [5, 6, 7], "parents"),  # a parent after its child
        ([0, -1], [5, 6], "parents"),  # a node its own parent: a cycle
        ([-1, 0], [5, 6, 7], "parents"),  # not one parent per node
        ([-1] * 64, [5] * 64, "draft"),  # more nodes than a worker scores
        ([-1, 0], [5, 49152], "draft"),  # an id ≥ V
        ([-1, 0], [5, 6], "path"),  # the next call: a path that is not a root-to-node path
    ],
)
def test_a_bad_tree_gets_a_400_naming_the_field_and_the_worker_goes_on(
    worker_url: str,
    in_process: ModelRunner,
    parents: list[int],
    draft: list[int],
    field: str,
) -> None:
    prompt = list(in_process.tokenizer.encode(TEXT))[:8]
    bad = VerifyRequest(
        "bad",
        0,
        prefix_hash([]),
        np.array(prompt),
        np.array(draft),
        parents=np.array(parents, dtype=np.int32),
    )
    if field == "path":  # a good tree, then a path that jumps from the root to its grandchild
        _post(worker_url, bad)
        agreed = prompt + [draft[1]]
        bad = VerifyRequest(
            "bad",
            len(agreed),
            prefix_hash(agreed),
            np.array([7]),
            np.array([]),
            path=np.array([1], dtype=np.int32),
        )
    body, content_type = encode(bad, 49152)
    resp = httpx.post(
        f"{worker_url}/v1/verify", content=body, headers={"content-type": content_type}, timeout=60
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == field, resp.text
    good = _post(worker_url, VerifyRequest("good", 0, prefix_hash([]), np.array(prompt), np.array([5]), k=4))
    assert good.probs is not None and good.probs.shape == (2, 4)
