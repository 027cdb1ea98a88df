"""No host sync inside a worker's step (issue 73), proven on the CPU by tests/syncs.py (the stand-in for a
GPU's sync debug mode): ``Steps.verify_batch`` on the static forward with device scoring, over calls of every
mode and payload — aggregate's top-k with each reconstruction and full rows, autoregressive's samples, exact's
chains and trees, split's accept test with its bonus, its rejected row or the token drawn at a rejection,
logprobs — at T 0, 0.7 and 1 with top-k / top-p / min-p, seeded and not, with a transform (bias, penalties,
min_tokens) and a grammar, and a tree's kept path moving cells: from the step's one upload to its one copy
back nothing reads a device value, sizes an output by one, or feeds host data to the device. Mutants that read
one scalar, or index by a 0-dim device tensor, are caught; a step still answers as the host does."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

import workers.device_scoring as device_scoring
from core.errors import InvalidRequest
from core.grammar import GrammarKind, GrammarSpec
from core.protocol import VerifyRequest, VerifyResponse, check_verify_request, prefix_hash
from core.runners.models import resolve_model
from core.runners.tokenizer import load_tokenizer
from core.runners.transformers_runner import TransformersRunner, tiny_random_model
from core.transform import TransformSpec
from tests.syncs import host_syncs
from tests.workers.test_device_scoring import _calls
from workers.scheduler import Timing
from workers.scoring import score
from workers.settings import WorkerSettings
from workers.state import WorkerState

V = 49152


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model("tiny-random"))


def _worker(tokenizer: Any, scoring: str = "device", **settings: Any) -> WorkerState:
    runner = TransformersRunner(
        resolve_model("tiny-random"),
        tokenizer,
        max_context=256,
        model=tiny_random_model(V, seed=5),
        memory_cap_mb=64,
        forward="static",
    )
    return WorkerState.build(
        WorkerSettings(
            model="tiny-random", backend="transformers", forward="static", scoring=scoring, **settings
        ),
        runner,
    )


def _transformed() -> list[VerifyRequest]:
    """A transform (bias, all three penalties, min_tokens) and a grammar, sampled and greedy, a chain each."""
    spec = TransformSpec(
        logit_bias=((9, 4.0), (70, -2.5)),
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.3,
        prompt_len=2,
        min_tokens=4,
        eos_ids=(2,),
    )
    grammar = TransformSpec(grammar=GrammarSpec(GrammarKind.REGEX, "[a-z ]{1,40}"), prompt_len=2)
    out = []
    for i, (wire, mode) in enumerate(
        [(spec, "aggregate"), (spec, "exact"), (grammar, "autoregressive"), (grammar, "aggregate")]
    ):
        draft = [] if mode == "autoregressive" else [30 + i, 31 + i]
        extra: dict[str, Any] = (
            {"support_ids": np.array([30 + i, 31 + i]), "support_sizes": np.array([1, 1], dtype=np.int32)}
            if mode == "exact"
            else {}
        )
        out.append(
            VerifyRequest.after(
                f"x{i}",
                [],
                [5, 6, 7],
                draft,
                mode=mode,
                k=8,
                temperature=0.0 if i == 3 else 0.9,
                seed=i,
                transform=wire.to_wire(),
                **extra,
            )
        )
    return out


def _steps(worker: WorkerState, calls: list[VerifyRequest], size: int = 16) -> list[Any]:
    answers = []
    for start in range(0, len(calls), size):
        chunk = calls[start : start + size]
        answers += worker.steps.verify_batch(chunk, [Timing() for _ in chunk])
    return answers


def _all_calls() -> list[VerifyRequest]:
    # tests/workers/test_device_scoring.py: every mode and payload (the worker's checks pass)
    calls = [req for req in _calls() if _valid(req)]
    # some forwarded alone
    calls = [dataclasses.replace(req, seeded=True) if i % 5 == 0 else req for i, req in enumerate(calls)]
    return calls + _transformed()


def _valid(req: VerifyRequest) -> bool:
    try:
        check_verify_request(req, V)
    except InvalidRequest:
        return False
    return True


def test_nothing_in_a_worker_step_waits_for_the_device(tokenizer: Any) -> None:
    worker = _worker(tokenizer)
    calls = _all_calls()
    with host_syncs(worker.runner) as syncs:
        answers = _steps(worker, calls)
    steps = -(-len(calls) // 16)
    assert syncs.found == [] and (syncs.sends, syncs.downloads) == (steps, steps), sorted(set(syncs.found))
    assert all(isinstance(a, VerifyResponse) for a in answers), [
        a for a in answers if not isinstance(a, VerifyResponse)
    ][:3]
    assert worker.counters["positions_scored_on_device"] == sum(len(req.draft) + 1 for req in calls)
    # a tree's accepted path kept on the next call: its cells moved in the step's upload, no sync either
    tree = next(req for req in calls if req.parents is not None and len(req.draft) >= 3)
    worker = _worker(tokenizer)
    worker.steps.verify_batch([tree], [Timing()])
    held = [*tree.tokens.tolist()]
    path = [0, 2]  # node 2 hangs under node 0: rows that are not contiguous, so the cells move
    agreed = held + [int(tree.draft[n]) for n in path]
    after = VerifyRequest.after(
        tree.session_id, agreed, [9], [11, 12], mode="aggregate", k=8, temperature=0.7, seed=3
    )
    after = dataclasses.replace(after, path=np.array(path, dtype=np.int64), prefix_hash=prefix_hash(agreed))
    moves: list[int] = []
    real = worker.runner._move_cells
    worker.runner._move_cells = lambda slot, index: moves.append(index.numel()) or real(slot, index)  # type: ignore[method-assign]
    with host_syncs(worker.runner) as syncs:
        (answer,) = worker.steps.verify_batch([after], [Timing()])
    assert moves == [len(held) + len(path)]
    assert (
        syncs.found == [] and (syncs.sends, syncs.downloads) == (1, 1) and isinstance(answer, VerifyResponse)
    ), answer
    assert worker.runner.length(tree.session_id) == len(agreed) + 3


@pytest.mark.parametrize("mutant", ["a scalar read", "a 0-dim index"])
def test_a_step_that_waits_for_the_device_is_caught(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch, mutant: str
) -> None:
    real = device_scoring.count_accepts
    if mutant == "a scalar read":
        # the accept test's count read on the host (``int(accepted)``): what a verdict by hand would do
        monkeypatch.setattr(
            device_scoring,
            "count_accepts",
            lambda u, a: torch.full((), int(real(u, a)), dtype=torch.long, device=u.device),
        )
    else:  # a row picked by a 0-dim device tensor (what split's bonus logprob did: ``norm[accepted, bonus]``)
        monkeypatch.setattr(
            device_scoring,
            "count_accepts",
            lambda u, a: u[real(u, a).clamp(max=u.numel() - 1)].long() * 0 + real(u, a),
        )
    worker = _worker(tokenizer)
    calls = [req for req in _calls() if req.mode == "split" and req.temperature > 0][:6]
    with host_syncs(worker.runner) as syncs:
        _steps(worker, calls)
    assert syncs.found and all("_local_scalar_dense" in line or "__int__" in line for line in syncs.found), (
        syncs.found
    )


def test_a_worker_step_answers_as_the_host_scores(tokenizer: Any) -> None:
    """The same calls through a worker scoring on the host: every answer the same (ids, samples, verdicts
    equal; probabilities within 1e-6) — the device's transforms, uniforms and top-k are the host's."""
    calls = _all_calls()
    device, host = _steps(_worker(tokenizer), calls), _steps(_worker(tokenizer, "host"), calls)
    for req, want, got in zip(calls, host, device):
        for field in dataclasses.fields(VerifyResponse):
            a, b = getattr(want, field.name), getattr(got, field.name)
            if field.name in ("model_ms", "batch_sessions"):
                continue
            if isinstance(a, np.ndarray):
                assert a.dtype == b.dtype and a.shape == b.shape, (req.session_id, field.name)
                assert (
                    np.allclose(a, b, rtol=0, atol=1e-6) if a.dtype.kind == "f" else np.array_equal(a, b)
                ), (req.session_id, field.name)
            else:
                assert a == b, (req.session_id, field.name, a, b)
    assert score is not None


async def test_a_pipelined_worker_answers_as_one_that_takes_a_step_at_a_time(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler's pipeline (a GPU's: the next step launched while the last runs on the device), forced on
    the CPU: 24 calls at once through a worker's routes, seeded (every mode), answer as on a worker that takes
    a step at a time."""
    import asyncio

    import httpx

    from tests.workers.test_scheduler import _answer, _post
    from workers.server import create_app
    from workers.step import Steps

    calls = [dataclasses.replace(req, seeded=True) for req in _all_calls()[:24]]

    async def run(overlap: bool) -> tuple[list[VerifyResponse], int]:
        monkeypatch.setattr(Steps, "overlaps", property(lambda self: overlap))
        # steps of a few calls: the queue holds the next while one runs
        worker = _worker(tokenizer, max_batch_tokens=24)
        app = create_app(worker.settings, runner=worker.runner)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client,
        ):
            answers = [_answer(resp) for resp in await asyncio.gather(*(_post(client, req) for req in calls))]
            return answers, app.state.worker.scheduler.overlapped

    alone, _ = await run(False)
    pipelined, overlapped = await run(True)
    assert overlapped > 0
    for want, got in zip(alone, pipelined):
        for field in dataclasses.fields(VerifyResponse):
            if field.name not in ("model_ms", "batch_sessions"):
                a, b = getattr(want, field.name), getattr(got, field.name)
                assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b, field.name


def test_the_detector_knows_a_number_set_by_an_index_from_one_made_on_the_device() -> None:
    """``x[rows, ids] = -inf`` copies a host number in (CUDA's index_put_ takes it as a 0-dim host tensor):
    refused; the same value made on the device (``torch.full((), -inf, device=...)``), or a number given to an
    elementwise op, is not."""
    from core.runners.step_upload import StepUpload

    upload = StepUpload(torch.device("cpu"), words=8)
    with host_syncs(upload) as syncs:
        upload.begin()
        at = upload.add(np.array([0, 2], dtype=np.int64))
        upload.send()
        rows = upload.view(at)
        out = torch.zeros(3, 4)
        syncs._mark(out)
        out.index_put_((rows,), torch.full((), float("-inf"), device=out.device))
        out.masked_fill_(out == 0, 1.0)
        assert syncs.found == []
        out[rows] = float("-inf")
        assert len(syncs.found) == 1 and "index_put" in syncs.found[0], syncs.found
