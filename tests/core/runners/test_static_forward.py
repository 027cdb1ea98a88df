"""The static forward (core/runners/static_forward.py, issue 60) on the CPU, eager: the transformers runner on
it gives the logits of the runner on transformers' own modules — mixed chains and a tree in one step,
prefills, padding to buckets — for Llama, Qwen2 (q/k/v biases) and Mistral configs (fp32: max |Δ logit| ≤
1e-4, argmax equal); a session's logits alone and inside a padded bucket agree; a step writes no cell but its
sessions' new rows and the scratch cells; what cannot take it (a pipeline stage, a sliding window) is refused
by name, and ``auto`` keeps the CPU on transformers'."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from core.errors import ModelLoadError
from core.runners.base import ForwardItem
from core.runners.models import resolve_model
from core.runners.tokenizer import load_tokenizer
from core.runners.transformers_runner import TransformersRunner, tiny_random_model

V = 49152
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model("tiny-random"))


def _qwen2(seed: int) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.5,
        tie_word_embeddings=False,
        use_sliding_window=False,
    )
    model = Qwen2ForCausalLM(config).float()
    for layer in model.model.layers:  # its q/k/v biases, non-zero
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            torch.nn.init.normal_(proj.bias, std=0.5)
    return model


def _mistral(seed: int) -> Any:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    config = MistralConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        initializer_range=0.5,
        sliding_window=None,
        rope_theta=500.0,
    )
    return MistralForCausalLM(config).float()


MODELS = {
    "llama": lambda: tiny_random_model(V, seed=3),
    "qwen2": lambda: _qwen2(4),
    "mistral": lambda: _mistral(5),
}


def _pair(tokenizer: Any, model: Any) -> tuple[TransformersRunner, TransformersRunner]:
    source = resolve_model("tiny-random")
    hf = TransformersRunner(source, tokenizer, max_context=512, model=model, memory_cap_mb=64, forward="hf")
    static = TransformersRunner(
        source, tokenizer, max_context=512, model=model, memory_cap_mb=64, forward="static"
    )
    assert (hf.forward_kind, static.forward_kind) == ("hf", "static")
    return hf, static


def _steps() -> list[list[ForwardItem]]:
    """Prefills of three lengths, then one step of two chains of different widths and a tree beside them, then
    a kept path and a chain again."""
    prompt = [(i * 37 + 11) % V for i in range(70)]
    return [
        [
            ForwardItem("a", 0, prompt[:70], logits_at=[69]),
            ForwardItem("b", 0, prompt[:9], logits_at=[0, 8]),
            ForwardItem("c", 0, prompt[:3]),
        ],
        [
            ForwardItem("a", 70, [5, 6, 7, 8, 9], logits_at=list(range(5))),
            ForwardItem("b", 9, [12], logits_at=[0]),
            # two branches
            ForwardItem(
                "c", 3, [20, 21, 22, 23, 24, 25], parents=[2, 2, 3, 3, 4, 5], logits_at=list(range(6))
            ),
        ],
    ]


def _run(runner: TransformersRunner) -> list[torch.Tensor]:
    out = []
    for step in _steps():
        out += runner.forward_each(step)  # type: ignore[arg-type]
    runner.keep("c", [0, 1, 2, 3, 5, 8])  # a root-to-node path of the tree: row 3 → its child 5 → 8
    out += runner.forward_each(
        [ForwardItem("c", 6, [30, 31], logits_at=[0, 1]), ForwardItem("a", 75, [40], logits_at=[0])]
    )  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize("family", sorted(MODELS))
def test_the_static_forward_gives_the_hf_forwards_logits(family: str, tokenizer: Any) -> None:
    hf, static = _pair(tokenizer, MODELS[family]())
    expected, found = _run(hf), _run(static)
    assert len(expected) == len(found) == 8
    for want, got in zip(expected, found):
        assert isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)
        assert want.shape == got.shape
        assert (want - got).abs().max().item() <= TOLERANCE
        assert torch.equal(want.argmax(-1), got.argmax(-1))


def test_a_session_alone_and_in_a_padded_bucket_agree_and_nothing_else_is_written(tokenizer: Any) -> None:
    """Session "x" forwarded alone (a bucket of one), then again in a step of three (padded to four sessions,
    its rows to a bucket of 24): equal logits (to the tolerance); the step wrote the three sessions' new cells
    and their scratch cells, and the padding session the scratch slot — no cell of the idle session "w", and
    no other cell, changed."""
    model = tiny_random_model(V, seed=7)
    _, static = _pair(tokenizer, model)
    _, other = _pair(tokenizer, model)
    prompt = [(i * 13 + 5) % V for i in range(20)]
    alone = static.forward_each([ForwardItem("x", 0, prompt, logits_at=[19])])[0]
    # w: idle after
    other.forward_each(
        [ForwardItem("w", 0, prompt[:4]), ForwardItem("y", 0, prompt[:5]), ForwardItem("z", 0, prompt[:2])]
    )
    before = [store.clone() for store in other._stores]
    together = other.forward_each(
        [
            ForwardItem("y", 5, [1, 2, 3]),
            ForwardItem("x", 0, prompt, logits_at=[19]),
            ForwardItem("z", 2, [4]),
        ]
    )
    assert isinstance(alone, torch.Tensor) and isinstance(together[1], torch.Tensor)
    assert (alone - together[1]).abs().max().item() <= TOLERANCE and torch.equal(
        alone.argmax(-1), together[1].argmax(-1)
    )
    slot_of = {s.session_id: s.index for s in other._slots if s.session_id}
    scratch_cell, scratch_slot = other.slot_length - 1, other.num_slots
    written = {(slot_of["y"], c) for c in range(5, 8)} | {(slot_of["z"], 2)}
    padding = {(slot_of[s], scratch_cell) for s in "yz"}  # the step's sessions' padding rows
    lent = slot_of["x"]  # a slot lent afresh: zeroed, then written (its memory before was anything)
    for was, now in zip(before, other._stores):  # [slots + 1, cells, 2, kv_heads, head_dim]
        # never-lent slots hold whatever memory held, NaN patterns included
        differ = (was != now) & ~(was.isnan() & now.isnan())
        # (slot, cell)
        changed = {
            (s, c) for s, c in differ.any(dim=(2, 3, 4)).nonzero().tolist() if s not in (scratch_slot, lent)
        }
        assert written <= changed <= written | padding, sorted(changed - written - padding)[:5]
        assert now[lent, 20:scratch_cell].eq(0).all()  # x's cells past its rows: the zeros lending left


def test_what_cannot_take_the_static_forward_is_refused_by_name_and_auto_keeps_the_cpus(
    tokenizer: Any,
) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    source = resolve_model("tiny-random")
    windowed = MistralForCausalLM(
        MistralConfig(
            vocab_size=V,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            sliding_window=256,
        )
    )
    with pytest.raises(ModelLoadError, match="a sliding window of 256"):
        TransformersRunner(
            source, tokenizer, max_context=512, model=windowed, memory_cap_mb=64, forward="static"
        )
    with pytest.raises(ModelLoadError, match="a pipeline stage"):
        TransformersRunner(
            source,
            tokenizer,
            max_context=512,
            model=tiny_random_model(V),
            memory_cap_mb=64,
            forward="static",
            layers=(0, 1),
        )
    with pytest.raises(ModelLoadError, match="unknown forward"):
        TransformersRunner(
            source, tokenizer, max_context=512, model=tiny_random_model(V), memory_cap_mb=64, forward="graph"
        )
    # auto, no CUDA
    assert (
        TransformersRunner(
            source, tokenizer, max_context=512, model=tiny_random_model(V), memory_cap_mb=64
        ).forward_kind
        == "hf"
    )


async def test_a_worker_on_the_static_forward_answers_as_one_on_transformers_modules(tokenizer: Any) -> None:
    """Through a worker's scheduler and scoring, eight calls at once (T = 1): aggregate's top-8 rows, split's
    accept test, exact's supports (a chain, a tree), autoregressive's sample with a transform (bias,
    penalties, min_tokens); chains of 0–4 draft tokens and two trees. On either forward the same ids, samples
    and verdicts, probabilities within 1e-5; and with the step scored together where the logits are
    (``--scoring device``, workers.device_scoring) every answer as the host's, within 1e-6."""
    import asyncio
    import dataclasses

    import httpx
    import numpy as np

    from core.protocol import VerifyRequest, VerifyResponse, decode, encode
    from core.transform import TransformSpec
    from workers.server import create_app
    from workers.settings import WorkerSettings

    model = tiny_random_model(V, seed=11)
    prompt = [504, 3458, 28, 638, 359, 346, 1485, 1834, 47, 378, 253, 1097]
    calls = []
    for i in range(8):
        parents = np.array([-1, -1, 0], dtype=np.int64) if i in (3, 6) else None
        draft = [7, 9, 11] if parents is not None else list(range(20, 20 + i % 5))
        if i % 4 == 1:  # split's accept test and bonus
            extra: dict[str, Any] = {
                "mode": "split",
                "draft_probs": np.full(len(draft), 0.5, dtype=np.float32),
                "logprobs": 1,
            }
        elif i % 4 == 2 or parents is not None:
            # exact's supports: each row's drafted tokens (a tree's: its children's) and two more
            if parents is None:
                drawn = [[x] for x in draft]
            else:
                drawn = [
                    sorted({draft[n] for n, p in enumerate(parents.tolist()) if p == row - 1})
                    for row in range(len(draft) + 1)
                ]
            ids = [x for j, mine in enumerate(drawn) for x in [*mine, 30 + j, 40 + j]]
            sizes = [len(mine) + 2 for mine in drawn]
            extra = {
                "mode": "exact",
                "support_ids": np.array(ids),
                "support_sizes": np.array(sizes, dtype=np.int32),
            }
        elif i == 7:  # autoregressive's sample, under a transform
            spec = TransformSpec(
                logit_bias=((9, 4.0),),
                presence_penalty=0.5,
                repetition_penalty=1.3,
                prompt_len=4 + i,
                min_tokens=2,
                eos_ids=(2,),
            )
            extra = {"mode": "autoregressive", "k": 8, "transform": spec.to_wire()}
            draft = []
        else:  # aggregate's top-8 rows
            extra = {"mode": "aggregate", "k": 8}
        calls.append(
            VerifyRequest.after(
                f"s{i}", [], prompt[: 4 + i], draft, parents=parents, temperature=1.0, seed=i, **extra
            )
        )
    answers, counters = {}, {}
    for kind, scoring in (("hf", "host"), ("static", "host"), ("static", "device")):
        runner = TransformersRunner(
            resolve_model("tiny-random"),
            tokenizer,
            max_context=512,
            model=model,
            memory_cap_mb=64,
            forward=kind,
        )
        app = create_app(
            WorkerSettings(model="tiny-random", backend="transformers", forward=kind, scoring=scoring),
            runner=runner,
        )
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client,
        ):

            async def verify(req: VerifyRequest) -> VerifyResponse:
                body, content_type = encode(req, V)
                resp = await client.post(
                    "/v1/verify", content=body, headers={"content-type": content_type, "accept": content_type}
                )
                assert resp.status_code == 200, resp.text
                return decode(VerifyResponse, resp.content, resp.headers["content-type"])

            answers[kind, scoring] = await asyncio.gather(*(verify(req) for req in calls))
            step = (await client.get("/v1/info")).json()["step"]
            # captured on a GPU only
            graphs = (
                {"graphs": 0, "capture_s": 0.0, "graph_mb": 0.0, "eager_forwards": 0}
                if kind == "static"
                else {}
            )
            ahead = {"decode_ahead": False}  # off by default (WorkerSettings.decode_ahead)
            assert {name: value for name, value in step.items() if name != "forwards"} == {
                "forward": kind,
                "scoring": scoring,
                **graphs,
                **ahead,
            }
            counters[kind, scoring] = app.state.worker.counters["positions_scored_on_device"]
            if runner._graphs is not None:
                # every step of these calls on a key start-up captures (on a GPU: a replay)
                assert (
                    runner._graphs.counts.steps
                    and runner._graphs.counts.eager_keys(runner._graphs.planned) == []
                )
    assert counters == {
        ("hf", "host"): 0,
        ("static", "host"): 0,
        ("static", "device"): sum(len(c.draft) + 1 for c in calls),
    }
    for hf, static, device in zip(
        answers["hf", "host"], answers["static", "host"], answers["static", "device"]
    ):
        assert hf.bonus == static.bonus and hf.num_accepted == static.num_accepted
        for name in ("ids", "samples", "complement_samples"):
            assert (getattr(hf, name) is None) == (getattr(static, name) is None), name
            if getattr(hf, name) is not None:
                assert np.array_equal(getattr(hf, name), getattr(static, name)), name
        for name in ("probs", "tail_mass", "draft_logprobs", "support_probs"):
            if getattr(hf, name) is not None:
                assert np.allclose(getattr(hf, name), getattr(static, name), atol=1e-5), name
        for field in dataclasses.fields(VerifyResponse):
            want, got = getattr(static, field.name), getattr(device, field.name)
            if field.name in ("model_ms", "batch_sessions"):
                continue
            if isinstance(want, np.ndarray):
                assert want.dtype == got.dtype and want.shape == got.shape, field.name
                assert np.allclose(want, got, rtol=0, atol=1e-6), field.name
            else:
                assert want == got, field.name


def test_a_step_runs_through_its_buckets_static_buffers(tokenizer: Any) -> None:
    """On the CPU a captured key's buffers run eagerly — the same buffers a CUDA graph replays on a GPU
    (tests/gpu): one set per key, reused by every step of that key, giving what the static forward gives on
    the step's own inputs; a step outside every captured key (more rows than the largest bucket) runs on its
    own inputs, keeps no buffers and is counted."""
    from core.runners.static_forward import BUCKETS, StepInputs, layout

    model = tiny_random_model(V, seed=9)
    _, static = _pair(tokenizer, model)
    prompt = [(i * 7 + 3) % V for i in range(100)]
    static.forward_each([ForwardItem("a", 0, prompt[:10]), ForwardItem("b", 0, prompt[:12])])
    graphs = static._graphs
    # nothing captured on the CPU
    assert graphs is not None and set(graphs.buckets) == {(2, 12, 128)} and graphs.capture_s == 0
    first = graphs.buckets[2, 12, 128]
    static.forward_each([ForwardItem("a", 10, [1, 2, 3]), ForwardItem("b", 12, [4])])
    assert set(graphs.buckets) == {(2, 12, 128), (2, 4, 128)}
    inputs = graphs.buckets[2, 4, 128].inputs.clone()
    static.forward_each([ForwardItem("a", 13, [5, 6]), ForwardItem("b", 13, [7, 8, 9])])
    # the second step of that key reused its buffers
    assert graphs.buckets[2, 4, 128] is not first and len(graphs.buckets) == 2
    bucket = graphs.buckets[2, 4, 128]
    assert not torch.equal(inputs, bucket.inputs)  # the step's own inputs copied in
    again = static._static.hidden(StepInputs(*layout(bucket.inputs.clone(), 2, 4)), 128)  # type: ignore[union-attr]
    assert bucket.hidden is not None and torch.equal(again, bucket.hidden)
    assert (graphs.counts.steps, graphs.counts.eager) == (3, 0)
    # a prefill past the largest bucket's rows
    static.forward_each([ForwardItem("c", 0, prompt[: BUCKETS.rows[-1] + 1])])
    assert (graphs.counts.steps, graphs.counts.eager) == (4, 1) and len(graphs.buckets) == 2


def test_an_item_alone_gets_a_forward_of_its_own_beside_the_shared_one(tokenizer: Any) -> None:
    """A seeded call's item (``alone``) is forwarded in buckets of its own — on a GPU the numbers of a
    bucket's matmuls depend on its shape, so this is what keeps a seeded text independent of what shares the
    step (tests/gpu hold the bits equal there) — and the others share one forward; each answer is what a
    runner given only that item gives, and sessions of the same step keep their slots while the groups take
    turns."""
    model = tiny_random_model(V, seed=9)
    _, static = _pair(tokenizer, model)
    _, solo = _pair(tokenizer, model)
    prompt = [(i * 7 + 3) % V for i in range(30)]
    items = [
        ForwardItem("a", 0, prompt[:10]),
        ForwardItem("s", 0, prompt[:7], alone=True),
        ForwardItem("b", 0, prompt[:12]),
        ForwardItem("t", 0, prompt[:3], alone=True),
    ]
    graphs = static._graphs
    assert graphs is not None
    runs: list[tuple[int, ...]] = []
    real = graphs.run
    graphs.run = lambda key, inputs: runs.append(key[:2]) or real(key, inputs)  # type: ignore[method-assign]
    got = static.forward_each(items)
    assert sorted(runs) == [(1, 4), (1, 8), (2, 12)]  # s alone, t alone, a and b together
    for item, logits in zip(items, got):
        want = solo.forward_each([ForwardItem(item.session_id, 0, item.tokens)])[0]
        assert isinstance(logits, torch.Tensor) and isinstance(want, torch.Tensor)
        assert (logits - want).abs().max().item() <= TOLERANCE, item.session_id
    assert {s.session_id for s in static._slots if s.session_id} == {"a", "b", "s", "t"}


async def test_a_gateways_draft_on_the_static_forward_drafts_as_on_transformers_modules(
    tokenizer: Any,
) -> None:
    """Issue 61, a draft on a GPU where the gateway has one (``draft: {backend: transformers, device: cuda}``:
    the static forward, as a worker's). On the CPU path here: ``draft.forward: static`` reaches the runner
    (``load_draft``), and the draft drafts the chains and trees it drafts on transformers' modules — greedy
    EAGLE-2 and sampled trees, a greedy and a truncated sampled chain, two at a time in shared steps — the
    same tokens, q̂ within the logits' tolerance. llama.cpp, which has one forward, refuses another by
    name."""
    import asyncio

    from app.drafting import DraftModel, DraftRequest
    from app.server import load_draft
    from core.config import DraftConfig, SpecgateConfig
    from core.math.sampling import SamplingParams
    from core.math.shapes import ChildRule, TreeShape
    from core.runners import load_runner
    from core.runners.model_thread import ModelThread

    config = SpecgateConfig(
        draft=DraftConfig(
            model="tiny-random:7",
            backend="transformers",
            device="cpu",
            dtype="float32",
            forward="static",
            memory_cap_mb=64,
        ),
        workers=[{"url": "http://127.0.0.1:1", "weight": 1.0}],
    )
    runner = load_draft(config)
    assert isinstance(runner, TransformersRunner) and runner.forward_kind == "static"
    with pytest.raises(ModelLoadError, match="one forward, its own"):
        load_runner("builtin-draft", "llama.cpp", forward="static")

    hf, static = _pair(tokenizer, tiny_random_model(V, seed=8))
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.9)
    prompt = [(i * 53 + 7) % V for i in range(12)]
    asks = [
        ("tree", greedy, TreeShape.default(True), (0, 1.0)),
        ("tree", sampled, TreeShape(ChildRule.SAMPLED_DISTINCT, widths=(2, 2, 1)), (32, 1.0)),
        ("chain", greedy, 4, (0, 1.0)),
        ("chain", sampled, 4, (32, 1.0)),
    ]

    async def drafts(runner: TransformersRunner) -> list[Any]:
        draft = DraftModel(runner, ModelThread())
        out = []
        for first, second in ((0, 1), (2, 3)):  # two drafts at a time: their steps shared
            calls = []
            for i in (first, second):
                kind, params, shape, truncation = asks[i]
                request = DraftRequest(f"s{i}", prompt[: 8 + i], params, 11 + i, 0, truncation)
                calls.append(
                    draft.propose_tree(request, shape) if kind == "tree" else draft.propose(request, shape)
                )  # type: ignore[arg-type]
            out += await asyncio.gather(*calls)
        return out

    for a, b in zip(await drafts(hf), await drafts(static)):
        assert len(a) > 1 and torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        # q̂ of each drafted token
        assert (a.q_values().double() - b.q_values().double()).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_decoder_layer_runs_at_most_20_kernels_over_inputs_that_grow_with_rows_not_cells(
    tokenizer: Any, family: str
) -> None:
    """Counted by a dispatch mode (clients.bench.kernels) on a step of chains and a tree in bf16: ≤ 20
    kernel-launching ops per decoder layer (issue 73: 44 before fusing q/k/v and gate/up, rotating in place,
    folding GQA's query groups instead of repeating K/V, one K/V write and one gather of the cells the step
    reads). The step's one upload holds its inputs and kept rows — words per row, none per cell: the mask is
    made on the device."""
    from clients.bench.kernels import per_layer
    from core.runners.static_forward import StepInputs, input_words, layout

    _, static = _pair(tokenizer, MODELS[family]().to(torch.bfloat16))
    graphs, upload = static._graphs, static.upload
    assert graphs is not None and upload is not None
    seen: list[tuple[tuple[int, int, int], torch.Tensor]] = []
    real = graphs.run
    graphs.run = lambda key, inputs: seen.append((key, inputs.clone())) or real(key, inputs)  # type: ignore[method-assign]
    _run(static)
    key, inputs = seen[1]  # the step of two chains and a tree
    sessions, rows, span = key
    assert key == (4, 6, 128)
    per, outside, layer = per_layer(static._static, StepInputs(*layout(inputs, sessions, rows)), span)
    assert per <= 20 and outside <= 20, (per, outside, layer)
    assert (
        layer["scaled_dot_product_attention"] == 1
        and layer["linear"] + layer["addmm"] == 4
        and "repeat_interleave" not in layer
    ), layer
    static.forward_each([ForwardItem("a", 76, [9, 9, 9], logits_at=[0, 1, 2])])
    assert upload._used == input_words(1, 4) + 3  # its inputs and its three kept rows


def test_every_step_at_or_below_the_largest_bucket_maps_to_a_key_start_up_captures(tokenizer: Any) -> None:
    """Graph coverage (issue 73): the step bench's steps (``specgate bench step-device``: 1–16 sessions × 1–17
    positions over 256 held tokens, chains scored together) on the static forward's CPU path, which pads as a
    GPU does, each map to a key of ``BUCKETS.captured`` — what start-up captures; only the prefills past the
    largest bucket's rows run eagerly. (The table that captured spans from 256 while steps padded spans from
    64 ran every step of a short session eagerly.)"""
    import numpy as np

    from clients.bench.step_cost import PREFIX, _step
    from core.runners.static_forward import BUCKETS

    runner = TransformersRunner(
        resolve_model("tiny-random"),
        tokenizer,
        max_context=1024,
        model=tiny_random_model(V, seed=2),
        memory_cap_mb=256,
        forward="static",
    )
    graphs = runner._graphs
    assert graphs is not None
    generator = np.random.default_rng(0)
    prompt = generator.integers(0, V, PREFIX).tolist()
    for batch in (1, 4, 8, 16):
        for positions in (1, 5, 17):
            _step(runner, f"b{batch}p{positions}", prompt, batch, positions, generator, together=True)()
    planned = set(BUCKETS.captured(runner.slot_length - 1))
    # spans 128, 512 and the session's most (1024)
    assert graphs.planned == planned and len(planned) == 5 * 11 * 3
    bench_steps = {key for key in graphs.counts.keys if key[1] <= BUCKETS.rows[-1]}
    assert bench_steps <= planned and len(bench_steps) == 12, sorted(bench_steps)
    assert graphs.counts.eager_keys(planned) == [(1, 256, 512)]  # the sessions' prefills of 256 tokens
