"""The static forward's CUDA graphs (issue 60): skipped where torch sees no GPU (CI); the device check runs them.

- A step replayed from a captured graph gives what the same static forward gives eagerly on the same buffers.
- Nothing inside a step's replay synchronises with the host (torch.cuda.set_sync_debug_mode: an error if anything does).
- A session alone and inside a padded bucket of other sessions scores alike (the chains of tests/gpu/test_cuda.py, on
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
        ModelSource("tiny-random", None, None), _Vocabulary(), max_context=2048, device="cuda", model=tiny_random_model(49152).to(dtype),
        forward="static", gpu_memory_utilization=0.3,
    )
    assert runner._graphs is not None and runner._graphs.capture_s > 0 and any(b.graph is not None for b in runner._graphs.buckets.values())
    return runner


def test_a_replayed_graph_gives_the_eager_forwards_hidden_states() -> None:
    runner = _runner()
    runner.forward_each([ForwardItem(f"s{k}", 0, PROMPT[: 4 + k]) for k in range(3)])
    runner.forward_each([ForwardItem(f"s{k}", 4 + k, [20 + k, 21], logits_at=[0, 1]) for k in range(3)])
    graphs = runner._graphs
    assert graphs is not None
    bucket = graphs.buckets[4, 2, 256]
    assert bucket.graph is not None and bucket.hidden is not None
    replayed = bucket.hidden.clone()
    eager = runner._static.hidden(bucket.tokens, bucket.positions, bucket.slots, bucket.cells, bucket.mask)  # type: ignore[union-attr]
    assert torch.allclose(replayed, eager, atol=1e-5)


def test_nothing_in_a_steps_replay_waits_for_the_host() -> None:
    runner = _runner(torch.bfloat16)
    runner.forward_each([ForwardItem("a", 0, PROMPT)])
    graphs = runner._graphs
    assert graphs is not None
    batch = torch.zeros(1, 4, dtype=torch.long, device="cuda")
    slots = torch.tensor([runner.num_slots], device="cuda")  # the scratch slot
    mask = torch.zeros(1, 4, 256, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        hidden = graphs.run(batch, batch, slots, batch + runner.slot_length - 1, mask)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert graphs.buckets[1, 4, 256].graph is not None and hidden.shape == (1, 4, runner.hidden_size)


def test_a_session_alone_and_in_a_padded_captured_bucket_agree() -> None:
    alone, shared = _runner(), _runner()
    want = alone.forward_each([ForwardItem("x", 0, PROMPT, logits_at=[11])])[0]
    shared.forward_each([ForwardItem("y", 0, PROMPT[:5]), ForwardItem("z", 0, PROMPT[:3])])
    got = shared.forward_each([ForwardItem("y", 5, [1, 2]), ForwardItem("x", 0, PROMPT, logits_at=[11]), ForwardItem("z", 3, [4])])[1]
    assert isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)
    assert (want - got).abs().max().item() <= 1e-4 and torch.equal(want.argmax(-1), got.argmax(-1))
