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
    with WorkerProcess("builtin", backend, timeout_s=300) as url:
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
