"""Fakes for testing the engine (the layer above runners and workers): Markov-chain "models"
over a small vocabulary behind the real ModelRunner, DraftModel and worker code."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import torch

from app.draft import DraftModel
from app.engine import Engine
from app.targets.base import Traffic, resend
from core.errors import SessionShort
from core.protocol import (
    BINARY_CONTENT_TYPE,
    ErrorBody,
    InfoResponse,
    VerifyRequest,
    VerifyResponse,
    check_verify_response,
    decode,
    encode,
    encode_json,
)
from core.runners.base import ModelRunner, Rows, RunnerInfo
from core.runners.model_thread import CallingThread
from workers.scoring import score
from workers.server import WorkerState
from workers.settings import WorkerSettings


class MarkovRunner(ModelRunner):
    """Logits of the next token depend on the last token only: ``table[last]`` — for a tree
    row too (its own token), so it is also the reference runner for trees."""

    def __init__(self, table: torch.Tensor, eos_ids: list[int] | None = None, name: str = "markov") -> None:
        super().__init__()
        self.table = table  # [V, V] logits
        self.info = RunnerInfo(model_id=name, backend="markov", vocab_size=table.shape[0], max_context=4096, eos_ids=eos_ids or [])
        self.tokenizer = None

    @property
    def fingerprint(self) -> str:  # type: ignore[override]
        return "markov"

    def _compute(self, session_id: str, rows: Rows, start: int, logits_rows: list[int]) -> torch.Tensor:
        return self.table[torch.tensor([rows.tokens[r] for r in logits_rows])].float()

    def forward_full(self, tokens: list[int], num_logits: int) -> torch.Tensor:
        return self.table[torch.tensor(tokens[-num_logits:])].float()

    def _keep_cache(self, session_id: str, rows: Rows, kept: list[int]) -> None: ...

    def _free_cache(self, session_id: str) -> None: ...

    def kv_bytes_per_token(self) -> int:
        return 0

    def next_probs(self, last: int, temperature: float = 1.0) -> torch.Tensor:
        return torch.softmax(self.table[last].double() / temperature, dim=-1)


def random_table(vocab: int, seed: int, sharpness: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, vocab, generator=g, dtype=torch.float64) * sharpness


class FakeWorker:
    """A worker in memory: the real WorkerState (sessions, crop/append, scoring) without HTTP."""

    def __init__(self, name: str, runner: MarkovRunner, weight: float) -> None:
        self.name, self.weight, self.url = name, weight, f"mem://{name}"
        self.state = WorkerState.build(WorkerSettings(model=name, max_sessions=10_000), runner)
        self.calls: list[VerifyRequest] = []

    async def verify(self, req: VerifyRequest, agreed: list[int]) -> tuple[VerifyResponse, Traffic]:
        """The worker's answer; on session_short, the resend the specgate dialect builds."""
        self.calls.append(req)
        try:
            resp = self.state.verify(req)
        except SessionShort as short:
            req = resend(req, agreed, short.held if short.held < req.prefix_len else 0)
            self.calls.append(req)
            resp = self.state.verify(req)
        check_verify_response(resp, req, self.state.runner.info.vocab_size)
        return resp, Traffic(sent=1, received=1, calls=1)

    async def delete_session(self, session_id: str) -> None:
        self.state.sessions.free(session_id)


class FakePool:
    def __init__(self, workers: list[FakeWorker]) -> None:
        self.workers = workers

    @property
    def weights(self) -> list[float]:
        return [w.weight for w in self.workers]

    async def delete_sessions(self, session_id: str) -> None:
        for worker in self.workers:
            await worker.delete_session(session_id)

    def scorable(self, sequence: list[int], draft: list[int]) -> int:
        return len(draft)


class InlineDraftModel(DraftModel):
    """The real DraftModel and its step loop, minus the thread hop (a Markov draft costs
    microseconds)."""

    def __init__(self, runner: MarkovRunner) -> None:
        super().__init__(runner, CallingThread())


def make_engine(draft: MarkovRunner, workers: list[tuple[MarkovRunner, float]], eos_ids: list[int] | None = None) -> Engine:
    pool = FakePool([FakeWorker(f"w{i}", runner, w) for i, (runner, w) in enumerate(workers)])
    return Engine(InlineDraftModel(draft), pool, eos_ids or [], max_context=4096)  # type: ignore[arg-type]


V = 49152
FAVOURITE = 1000  # the fake target's most likely next token, after any context

Mutation = Callable[[VerifyResponse], bytes]  # a correct answer → the bytes a broken worker sends


class FakeWorkerTransport:
    """Answers protocol v1 for several fake workers, told apart by host; ``behaviour[host]``
    breaks one: "down", "500", "garbage", "short-once", "other-tokenizer", "sleep:S" (answers
    after S seconds), "die-after:N" (down after N verify calls), "full" (503 worker_full to every
    verify call; "full:N" to the next N), or a Mutation of its answers."""

    def __init__(self, fingerprint: str, behaviour: dict[str, str | Mutation] | None = None) -> None:
        self.fingerprint = fingerprint
        self.behaviour = behaviour or {}
        self.requests: list[tuple[str, VerifyRequest]] = []
        self.deleted: list[str] = []
        self.authorization: list[str | None] = []  # the header of each request, in order
        self.bytes_in = self.bytes_out = 0  # verify bodies received / sent, as on the wire

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        behaviour = self.behaviour.get(request.url.host, "")
        if isinstance(behaviour, str) and behaviour.startswith("sleep:"):
            await asyncio.sleep(float(behaviour.split(":")[1]))
        response = self._answer(request)
        if request.url.path == "/v1/verify":
            self.bytes_in += len(request.content)
            self.bytes_out += len(response.content)
        return response

    def _answer(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        self.authorization.append(request.headers.get("authorization"))
        mode = self.behaviour.get(host, "")
        if isinstance(mode, str) and mode.startswith("die-after:"):
            left = int(mode.split(":")[1]) - (request.url.path == "/v1/verify")
            self.behaviour[host] = "down" if left < 0 else f"die-after:{left}"
            mode = self.behaviour[host]
        if mode == "down":
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if request.url.path == "/v1/info":
            info = InfoResponse(1, ["aggregate", "autoregressive"], host, V, "other" if mode == "other-tokenizer" else self.fingerprint, [2], 2048, "fake")
            return httpx.Response(200, content=encode_json(info), headers={"content-type": "application/json"})
        if request.method == "DELETE":
            self.deleted.append(request.url.path)
            return httpx.Response(204)
        req = decode(VerifyRequest, request.content, request.headers["content-type"])
        self.requests.append((host, req))
        if mode == "500":
            return httpx.Response(500, content=ErrorBody("boom", "server_error").to_json())
        if isinstance(mode, str) and mode.startswith("full"):
            left = int(mode.split(":")[1]) if ":" in mode else None
            if left is not None:
                self.behaviour[host] = f"full:{left - 1}" if left > 1 else ""
            message = "worker full: every KV slot is held by one of the 8 sessions used in the last 10 s; retry after 1 s"
            return httpx.Response(503, content=ErrorBody(message, "server_error", code="worker_full").to_json(), headers={"retry-after": "1"})
        if mode == "garbage":
            return httpx.Response(200, content=b"SGv1\x05\x00\x00\x00{oops", headers={"content-type": BINARY_CONTENT_TYPE})
        if mode == "short-once" and req.prefix_len > 0:
            self.behaviour[host] = ""
            return httpx.Response(409, content=ErrorBody("lost", "session_short", code="session_short", held=0).to_json())
        logits = torch.full((len(req.draft) + 1, V), -10.0)
        logits[:, FAVOURITE] = 3.0
        logits[:, FAVOURITE + 1] = 2.0
        prompt_logits = torch.full((max(len(req.tokens) - 1, 0), V), -10.0) if req.score_tokens else None  # echo: the prompt's rows alike
        if prompt_logits is not None:
            prompt_logits[:, FAVOURITE] = 3.0
        resp = score(logits, req, held=req.prefix_len + len(req.tokens) + len(req.draft), model_ms=0.1, prompt_logits=prompt_logits)
        if callable(mode):
            return httpx.Response(200, content=mode(resp), headers={"content-type": BINARY_CONTENT_TYPE})
        body, content_type = encode(resp, V)
        return httpx.Response(200, content=body, headers={"content-type": content_type})
