"""The static forward's CUDA graphs (issue 60): skipped where torch sees no GPU (CI); the device check runs
them.

- A step replayed from a captured graph gives what the same static forward gives eagerly on the same buffers.
- Nothing inside a step's replay synchronises with the host (torch.cuda.set_sync_debug_mode: an error if
  anything does).
- A session alone and inside a padded bucket of other sessions scores alike (the chains of
  tests/gpu/test_cuda.py, on
  the captured path).
"""

from __future__ import annotations

import pytest
import torch

from clients.bench.round_cost import _Vocabulary
from core.runners.base import ForwardItem
from core.runners.models import ModelSource
from core.runners.transformers_runner import TransformersRunner, tiny_random_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPT = [504, 3458, 28, 638, 359, 346, 1485, 1834, 47, 378, 253, 1097]


def _runner(dtype: torch.dtype = torch.float32) -> TransformersRunner:
    runner = TransformersRunner(
        ModelSource("tiny-random", None, None),
        _Vocabulary(),
        max_context=2048,
        device="cuda",
        model=tiny_random_model(49152).to(dtype),
        forward="static",
        gpu_memory_utilization=0.3,
    )
    assert (
        runner._graphs is not None
        and runner._graphs.capture_s > 0
        and any(b.graph is not None for b in runner._graphs.buckets.values())
    )
    return runner


def test_a_replayed_graph_gives_the_eager_forwards_hidden_states() -> None:
    from core.runners.static_forward import StepInputs, layout

    runner = _runner()
    runner.forward_each([ForwardItem(f"s{k}", 0, PROMPT[: 4 + k]) for k in range(3)])
    runner.forward_each([ForwardItem(f"s{k}", 4 + k, [20 + k, 21], logits_at=[0, 1]) for k in range(3)])
    graphs = runner._graphs
    assert graphs is not None and graphs.counts.eager == 0
    bucket = graphs.buckets[4, 2, 128]  # three sessions of two new rows, seeing fewer than 128 cells
    assert bucket.graph is not None and bucket.hidden is not None and graphs.counts.keys.get((4, 2, 128)) == 1
    replayed = bucket.hidden.clone()
    eager = runner._static.hidden(StepInputs(*layout(bucket.inputs.clone(), 4, 2)), 128)  # type: ignore[union-attr]
    assert torch.allclose(replayed, eager, atol=1e-5)


def test_nothing_in_a_runner_step_waits_for_the_host() -> None:
    """A whole static step — the host's inputs in the step's one upload, the replay, the head on the kept rows
    — with the logits left on the device: torch.cuda.set_sync_debug_mode("error") raises at any synchronising
    call inside it."""
    runner = _runner(torch.bfloat16)
    runner.forward_each([ForwardItem("a", 0, PROMPT), ForwardItem("b", 0, PROMPT[:5])])
    runner.logits_on_device = True

    def items(n: int) -> list[ForwardItem]:
        return [
            ForwardItem("a", 12 + n, [7, 8, 9], logits_at=[0, 1, 2]),
            ForwardItem("b", 5 + n, [4], parents=[4 + n]),
        ]

    # both host buffers used once (a later begin() waits on the copy two steps back)
    runner.forward_each(items(0))
    runner.crop("a", 12), runner.crop("b", 5)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = runner.forward_each(items(0))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [tuple(o.shape) for o in out] == [(3, 49152), (1, 49152)] and all(o.is_cuda for o in out)  # type: ignore[union-attr]


def test_a_session_alone_and_in_a_padded_captured_bucket_agree() -> None:
    alone, shared = _runner(), _runner()
    want = alone.forward_each([ForwardItem("x", 0, PROMPT, logits_at=[11])])[0]
    shared.forward_each([ForwardItem("y", 0, PROMPT[:5]), ForwardItem("z", 0, PROMPT[:3])])
    got = shared.forward_each(
        [ForwardItem("y", 5, [1, 2]), ForwardItem("x", 0, PROMPT, logits_at=[11]), ForwardItem("z", 3, [4])]
    )[1]
    assert isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)
    assert (want - got).abs().max().item() <= 1e-4 and torch.equal(want.argmax(-1), got.argmax(-1))


def test_a_seeded_session_gets_the_same_bits_whatever_shares_its_steps() -> None:
    """The seeded promise on a GPU (docs/performance.md): a seeded call (``alone``) gets logits equal bit for
    bit to its run alone, over a prefill and four decode steps, in bf16 on the built-in architecture, while
    fifteen other sessions share every step; and the device scorer's answer for it is the same alone or beside
    fifteen other calls."""
    from core.protocol import VerifyRequest
    from core.runners.transformers_runner import builtin_architecture_model
    from workers.device_scoring import score_step

    def runner() -> TransformersRunner:
        return TransformersRunner(
            ModelSource("tiny-random", None, None),
            _Vocabulary(),
            max_context=2048,
            device="cuda",
            model=builtin_architecture_model(dtype=torch.bfloat16),
            forward="static",
            gpu_memory_utilization=0.3,
        )

    alone, shared = runner(), runner()
    prompt = [(i * 37 + 11) % 49152 for i in range(200)]
    mine = [ForwardItem("x", 0, prompt, logits_at=[199], alone=True)]
    for step in range(5):
        want = alone.forward_each(mine)[0]
        others = [  # prompts of 30-44 tokens, then one token a step each
            ForwardItem(f"o{k}", 0, prompt[: 30 + k])
            if step == 0
            else ForwardItem(f"o{k}", 30 + k + step - 1, [prompt[30 + k + step - 1]])
            for k in range(15)
        ]
        got = shared.forward_each([*others[:7], *mine, *others[7:]])[7]
        assert isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and torch.equal(want, got), (
            step
        )
        token = int(want[-1].argmax())
        mine = [ForwardItem("x", 200 + step, [token], alone=True)]
    logits = torch.randn(16 * 5, 49152, device="cuda") * 3
    calls = [
        VerifyRequest.after(
            f"c{k}", [], [1, 2], [3, 4, 5, 6], mode="aggregate", k=20, temperature=0.7, top_p=0.9, seed=k
        )
        for k in range(16)
    ]
    together = score_step(logits, calls, [6] * 16, 0.0)[3]
    by_itself = score_step(logits[15:20].clone(), calls[3:4], [6], 0.0)[0]
    assert all(
        bool((getattr(together, n) == getattr(by_itself, n)).all()) for n in ("ids", "probs", "tail_mass")
    )


def test_the_device_scorer_on_the_gpu_answers_as_the_host_and_waits_for_it_once() -> None:
    """workers.device_scoring on CUDA tensors against workers.scoring on the host (the CPU test's grid of
    every mode and payload), and within a step's scoring one synchronising operation: the copy back."""
    import warnings

    from tests.workers.test_device_scoring import _calls, _logits, _same
    from workers.device_scoring import score_step
    from workers.scoring import score

    calls = _calls()
    sizes = [len(req.draft) + 1 for req in calls]
    logits = _logits(sum(sizes))
    helds = [6] * len(calls)
    score_step(logits.cuda(), calls, helds, 0.0)  # warm: the pinned buffers and kernels
    device = logits.cuda()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            answers = score_step(device, calls, helds, 0.0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in seen if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    for req, rows, got in zip(calls, torch.split(logits, sizes), answers):
        _same(score(rows.clone(), req, 6, 0.0), got, f"{req.mode} k={req.k} T={req.temperature}")


def test_a_transform_on_the_gpu_transforms_as_on_the_host() -> None:
    """core.transform on CUDA rows (bias, penalties, min_tokens, and a grammar's mask sent as packed bits) =
    on the host's."""
    import numpy as np

    from core.transform import LogitsTransform, TransformSpec, on_device

    spec = TransformSpec(
        logit_bias=((9, 4.0), (70, -2.5)),
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.3,
        prompt_len=3,
        min_tokens=4,
        eos_ids=(2,),
    )
    transformer = LogitsTransform.build(spec, 3001, None)
    logits = torch.randn(4, 3001, generator=torch.Generator().manual_seed(2))
    agreed, paths = [5, 6, 7, 9, 9], [[], [9], [9, 70], [1]]
    assert torch.equal(
        transformer.rows(logits.cuda(), agreed, paths).cpu(), transformer.rows(logits, agreed, paths)
    )
    mask = torch.from_numpy(np.random.default_rng(1).random((4, 3001)) < 0.5)
    assert torch.equal(on_device(mask, torch.device("cuda")).cpu(), mask)


def test_a_worker_step_on_the_gpu_waits_for_the_device_once() -> None:
    """Issue 73 on the GPU what tests/workers/test_step_syncs.py proves on the CPU: a worker's steps on the
    static forward with device scoring — every mode and payload, trees, seeded calls, a transform (and a
    grammar where llguidance is) — run under CUDA's sync debug mode; each step synchronises once, at its one
    copy back, and every forward replays a graph."""
    import importlib.util
    import warnings

    from core.runners.models import resolve_model
    from core.runners.tokenizer import load_tokenizer
    from tests.workers.test_step_syncs import _all_calls
    from workers.scheduler import Timing
    from workers.settings import WorkerSettings
    from workers.state import WorkerState

    runner = TransformersRunner(
        resolve_model("tiny-random"),
        load_tokenizer(resolve_model("tiny-random")),
        max_context=256,
        device="cuda",
        model=tiny_random_model(49152, seed=5),
        forward="static",
        gpu_memory_utilization=0.3,
    )
    worker = WorkerState.build(
        WorkerSettings(
            model="tiny-random", backend="transformers", device="cuda", forward="static", scoring="device"
        ),
        runner,
    )
    calls = [
        c
        for c in _all_calls()
        if c.transform is None or "grammar" not in c.transform or importlib.util.find_spec("llguidance")
    ]
    chunks = [calls[i : i + 16] for i in range(0, len(calls), 16)]
    worker.steps.verify_batch(
        chunks[0], [Timing() for _ in chunks[0]]
    )  # warm: kernels chosen, buffers allocated
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            answers = [
                a for chunk in chunks[1:] for a in worker.steps.verify_batch(chunk, [Timing() for _ in chunk])
            ]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{w.filename}:{w.lineno} {w.message}" for w in seen if "synchroniz" in str(w.message)]
    assert len(syncs) == len(chunks) - 1, syncs[:8]
    assert not [a for a in answers if isinstance(a, Exception)], [
        a for a in answers if isinstance(a, Exception)
    ][:3]
    graphs = runner._graphs
    assert graphs is not None and graphs.counts.eager_keys(graphs.planned) == [], graphs.counts.keys


def test_the_devices_philox_and_transforms_are_the_hosts_bit_for_bit() -> None:
    """core.math.random.philox_uniforms on CUDA = the host's Philox; LogitsTransform.device_plan applied to
    CUDA rows = rows() on the host."""
    import numpy as np

    from core.math.random import Purpose, _uniform, philox_uniforms, stream_key
    from core.runners.step_upload import StepUpload
    from core.transform import LogitsTransform, TransformSpec

    keys = [stream_key(s, s % 3, list(Purpose)[s % len(Purpose)], s % 2) for s in range(500)]
    positions = [s * 7919 + (2**32 if s % 5 == 0 else 0) for s in range(500)]
    got = philox_uniforms(torch.tensor(keys, device="cuda"), torch.tensor(positions, device="cuda")).cpu()
    assert torch.equal(
        got, torch.tensor([_uniform(k, p) for k, p in zip(keys, positions)], dtype=torch.float64)
    )
    spec = TransformSpec(
        logit_bias=((9, 4.0), (70, -2.5)),
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.3,
        prompt_len=3,
        min_tokens=4,
        eos_ids=(2,),
    )
    transformer = LogitsTransform.build(spec, 3001, None)
    logits = torch.randn(4, 3001, generator=torch.Generator().manual_seed(3))
    agreed, paths = [5, 6, 7, 9, 9], [[], [9], [9, 70], [1]]
    upload = StepUpload(torch.device("cuda"))
    upload.begin()
    plan = transformer.device_plan(agreed, paths, upload)
    upload.send()
    assert torch.equal(plan.apply(logits.cuda()).cpu(), transformer.rows(logits, agreed, paths))
    assert np.isfinite(logits.numpy()).all()
