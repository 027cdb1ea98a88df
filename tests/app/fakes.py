"""Fakes for testing the engine (the layer above runners and workers): Markov-chain "models"
over a small vocabulary behind the real ModelRunner, DraftModel and worker code."""

from __future__ import annotations

import torch

from app.draft import Draft, DraftModel
from app.engine import Engine
from app.pool import Traffic
from core.math.sampling import SamplingParams
from core.protocol import VerifyRequest, VerifyResponse, check_verify_response
from core.runners.base import ModelRunner, RunnerInfo
from workers.server import WorkerState
from workers.settings import WorkerSettings


class MarkovRunner(ModelRunner):
    """Logits of the next token depend on the last token only: ``table[last]``."""

    def __init__(self, table: torch.Tensor, eos_ids: list[int] | None = None, name: str = "markov") -> None:
        super().__init__()
        self.table = table  # [V, V] logits
        self.info = RunnerInfo(model_id=name, backend="markov", vocab_size=table.shape[0], max_context=4096, eos_ids=eos_ids or [])
        self.tokenizer = None

    @property
    def fingerprint(self) -> str:  # type: ignore[override]
        return "markov"

    def _forward(self, session_id: str, tokens: list[int], num_logits: int) -> torch.Tensor:
        return self.table[torch.tensor(tokens[-num_logits:])].float()

    def forward_full(self, tokens: list[int], num_logits: int) -> torch.Tensor:
        return self.table[torch.tensor(tokens[-num_logits:])].float()

    def _crop_cache(self, session_id: str, length: int) -> None: ...

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


class InlineDraftModel(DraftModel):
    """The real DraftModel, minus the thread hop (a Markov draft costs microseconds)."""

    async def propose(self, session_id: str, sequence: list[int], gamma: int, params: SamplingParams, seed: int, choice: int, truncation: tuple[int, float] = (0, 1.0)) -> Draft:
        return self._propose(session_id, sequence, gamma, params, seed, choice, truncation)

    async def free(self, session_id: str) -> None:
        self.runner.free(session_id)


def make_engine(draft: MarkovRunner, workers: list[tuple[MarkovRunner, float]], eos_ids: list[int] | None = None) -> Engine:
    pool = FakePool([FakeWorker(f"w{i}", runner, w) for i, (runner, w) in enumerate(workers)])
    return Engine(InlineDraftModel(draft), pool, eos_ids or [], max_context=4096)  # type: ignore[arg-type]
