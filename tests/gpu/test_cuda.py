"""The worker on CUDA (docs/design.md §9): skipped where torch sees no GPU (CI); run them where one is.

- A scheduler step's sessions in one bf16 forward score what each scores alone (the slot cache
  on the GPU: chains of mixed lengths and a tree in one forward).
- bf16 against fp32 on the GPU: argmax agreement over 200 positions ≥ 99 %, and the
  probabilities that leave the runner are fp32.
The lossless modes' verification runs on what the runner returns (fp32 rows on the host), the
same code the CPU's chi-square tests check; those run here too (``pytest tests/core/math``).
"""

from __future__ import annotations

import pytest
import torch

from clients.bench.round_cost import _Vocabulary
from core.runners.base import ForwardItem
from core.runners.models import ModelSource
from core.runners.transformers_runner import TransformersRunner, tiny_random_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOKENS = [504, 3458, 28, 638, 359, 346, 1485, 1834, 47, 378, 253, 1097]
TREE_PARENTS = [-1, -1, 0, 0, 1, 2]


def _runner(dtype: torch.dtype) -> TransformersRunner:
    """tiny-random on the GPU, built in code (a GPU box may lack the built-in GGUF's tokenizer)."""
    return TransformersRunner(
        ModelSource("tiny-random", None, None),
        _Vocabulary(),
        device="cuda",
        model=tiny_random_model(49152).to(dtype),
    )


def test_a_step_on_the_gpu_in_bf16_scores_as_one_at_a_time() -> None:
    runner = _runner(torch.bfloat16)
    prompts = [(TOKENS * 3)[k : k + n] for k, n in enumerate([9, 4, 15, 6, 11, 3, 20])]

    def items() -> list[ForwardItem]:
        out = [
            ForwardItem(f"s{k}", len(p), [20 + k] * (1 + k % 4), logits_at=list(range(1 + k % 4)))
            for k, p in enumerate(prompts)
        ]
        base = len(TOKENS)
        out.append(
            ForwardItem(
                "t",
                base,
                [30, 31, 32, 33, 34, 35],
                parents=[base - 1 if p < 0 else base + p for p in TREE_PARENTS],
                logits_at=list(range(6)),
            )
        )
        return out

    def setup() -> None:
        runner.free_all()
        for k, prompt in enumerate(prompts):
            runner.prefill(f"s{k}", prompt, 1)
        runner.prefill("t", TOKENS, 1)

    setup()
    alone = [runner.forward([item])[0] for item in items()]
    setup()
    together = runner.forward_each(items())
    for one, shared in zip(alone, together):
        assert (
            isinstance(shared, torch.Tensor) and shared.dtype == torch.float32 and shared.device.type == "cpu"
        )
        assert torch.equal(one.argmax(-1), shared.argmax(-1))
        torch.testing.assert_close(torch.softmax(shared, -1), torch.softmax(one, -1), atol=2e-2, rtol=0)


TEXT = (
    "The river town grew slowly through the long winters of the north. Fishermen mended their nets by the "
    "harbour while merchants argued over the price of salt and wool. In spring the ice broke on "
    "the lakes, and "
    "boats carried timber down to the coast, where shipwrights built the vessels that would "
    "later sail to distant "
    "ports. Children learned to read in a small school beside the church, and the old teacher "
    "kept a diary of "
    "every flood, every harvest and every fire. Historians today use those pages to understand how ordinary "
    "families lived, what they ate, which songs they sang and how they prepared for the dark "
    "months of the year. "
    "When the railway finally reached the valley, everything changed within a single generation: "
    "young people left "
    "for the factories of the south, the school closed, and the harbour filled with pleasure "
    "boats instead of "
    "fishing fleets. Yet every summer the families returned for the festival of lanterns, when "
    "the whole town "
    "walked to the water at dusk and set small paper boats adrift, each carrying a candle and a name."
)


def test_bf16_agrees_with_fp32_on_the_argmax() -> None:
    """The built-in target (dequantized by transformers) in bf16 and fp32 on the GPU: the argmax
    of 200 positions of a text agrees at ≥ 99 % of them."""
    from core.errors import ModelLoadError
    from core.runners import load_runner

    try:
        fp32 = load_runner("builtin", "transformers", device="cuda", dtype="float32")
    except ModelLoadError as exc:
        pytest.skip(f"the built-in model is not installed here: {exc}")
    bf16 = load_runner("builtin", "transformers", device="cuda", dtype="bfloat16")
    tokens = list(fp32.tokenizer.encode(TEXT))[:200]
    assert len(tokens) == 200
    a, b = fp32.prefill("a", tokens, 200), bf16.prefill("a", tokens, 200)
    assert a.dtype == b.dtype == torch.float32
    agreement = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    print(f"bf16 vs fp32 argmax agreement over 200 positions: {agreement:.3f}")
    assert agreement >= 0.99, agreement
