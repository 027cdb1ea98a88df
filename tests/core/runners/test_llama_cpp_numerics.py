"""Where llama.cpp's numerics change, measured on the built-in model (issue 58), and the runner kept clear of
it.

On the CPU, flash attention has three kernels: rows of a stream in a micro-batch of 64 or more take a tiled
one; a micro-batch of one token whose KV view reaches 512 cells (its stream holds more than 256) takes a
split-KV one that sums the cache in one part per thread; the rest take the plain one. Each gives other
last bits. The first half measures that on a bare llama.cpp context (so an upgrade of llama.cpp that moves
a boundary fails here, not in a user's seeded text); the second holds the runner to it on two threads (the
split-KV kernel's parts are its threads: on one thread it is the plain kernel, which is why the rest of the
suite, on one thread a process, could not see it): a long session scores bit for bit the same token by
token, in pieces cut anywhere, beside other sessions, from the prompt cache and as tree nodes."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import core.runners.llama_cpp_runner as llama_cpp_runner
from core.runners.base import ForwardItem
from core.runners.llama_cpp_runner import DECODE_TOKENS, KV_PAD, LlamaCppRunner
from core.runners.llama_cpp_tools import quiet_llama_cpp
from core.runners.models import resolve_model
from tests.app.helpers import FULL_RUN

THREADS = 2  # the split-KV kernel has one part per thread: one thread would hide it
PROMPT = [int(t) for t in np.random.default_rng(58).integers(100, 20_000, 300)]


class Bare:
    """The built-in target in a bare llama.cpp context (the runner's settings but micro-batches of up to 128),
    one sequence."""

    def __init__(self, threads: int) -> None:
        import llama_cpp
        from llama_cpp import _internals

        quiet_llama_cpp()
        self.api = llama_cpp
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = _internals.LlamaModel(
            path_model=str(resolve_model("builtin").path), params=params, verbose=False
        )
        ctx = llama_cpp.llama_context_default_params()
        ctx.n_ctx, ctx.n_batch, ctx.n_ubatch = 1024, 128, 128
        ctx.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        ctx.n_threads = ctx.n_threads_batch = threads
        ctx.no_perf = True
        self.ctx = _internals.LlamaContext(model=self.model, params=ctx, verbose=False)
        self.batch = _internals.LlamaBatch(n_tokens=128, embd=0, n_seq_max=1, verbose=False)
        self.vocab = int(self.model.n_vocab())
        self.held = 0  # PROMPT[:held] is in the context

    def last_logits(self, held: int, decode: int) -> np.ndarray:
        """``PROMPT[:held]`` held (decodes of 2 to 16), then ``PROMPT[held:held + decode]`` as one decode: its
        last row's logits."""
        self._hold(held)
        self._decode(held, held + decode)
        row = ctypes.cast(self.ctx.get_logits_ith(decode - 1), ctypes.POINTER(ctypes.c_float))
        logits = np.ctypeslib.as_array(row, shape=(self.vocab,)).copy()
        self._hold(held)
        return logits

    def _hold(self, held: int) -> None:
        """Keep or extend the held prompt to ``held`` rows, in decodes of at least two (no split-KV kernel in
        the prefix)."""
        start = min(self.held, held)
        if held - start == 1 and start > 0:
            start -= 1
        self.api.llama_memory_seq_rm(self.ctx.memory, 0, start, -1)
        for begin, end in llama_cpp_runner._spans(held - start, 16):
            # the runner's cuts: no last piece of one after others
            self._decode(start + begin, start + end)
        self.held = held

    def _decode(self, begin: int, end: int) -> None:
        raw = self.batch.batch
        raw.n_tokens = end - begin
        for i, position in enumerate(range(begin, end)):
            raw.token[i], raw.pos[i], raw.n_seq_id[i], raw.logits[i] = (
                PROMPT[position],
                position,
                1,
                position == end - 1,
            )
            raw.seq_id[i][0] = 0
        self.ctx.decode(self.batch)

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()
        self.model.close()


@pytest.fixture(scope="module")
def bare() -> Iterator[Bare]:
    context = Bare(THREADS)
    yield context
    context.close()


def test_rows_in_a_micro_batch_of_64_take_another_kernel(bare: Bare) -> None:
    """A position's logits in decodes of 1 to 63 tokens are one array; in a decode of 64 they are not (the
    tiled kernel): the runner's decodes stay under it."""
    end = 140  # a short context: no split-KV kernel for the decode of one
    reference = bare.last_logits(end - 2, 2)
    for size in (1, 17, 32, 63):
        assert np.array_equal(bare.last_logits(end - size, size), reference), size
    assert not np.array_equal(bare.last_logits(end - 64, 64), reference)
    assert DECODE_TOKENS < 64


def test_one_token_past_256_cells_takes_the_split_kernel_on_more_than_one_thread(bare: Bare) -> None:
    """A decode of one token whose stream then holds 256 cells scores as in a decode of two; holding 257 it
    does not (two threads: two parts of the cache, summed); the runner's ``KV_PAD`` is that boundary. On one
    thread the kernel is the plain one: every decode agrees."""
    for cells, alike in ((KV_PAD, True), (KV_PAD + 1, False), (300, False)):
        one, two = bare.last_logits(cells - 1, 1), bare.last_logits(cells - 2, 2)
        assert np.array_equal(one, two) is alike, cells
    single = Bare(threads=1)
    try:
        assert np.array_equal(single.last_logits(299, 1), single.last_logits(298, 2))
        # the plain kernel: any thread count
        assert np.array_equal(single.last_logits(298, 2), bare.last_logits(298, 2))
    finally:
        single.close()


@pytest.fixture
def runner(builtin_llama_two_threads: LlamaCppRunner) -> LlamaCppRunner:
    assert (
        isinstance(builtin_llama_two_threads, LlamaCppRunner) and builtin_llama_two_threads.threads == THREADS
    )
    return builtin_llama_two_threads


def test_a_long_session_scores_alike_however_its_rows_are_decoded(runner: LlamaCppRunner) -> None:
    """Rows past 256 cells token by token (each a decode of one), in pieces cut anywhere (a worker's chunked
    prefill, the draft's background chunks), whole, and the reference: bit for bit one array."""
    reference = runner.forward_full(PROMPT[:280], 30)
    runner.prefill("steps", PROMPT[:250], 1)
    before = runner.one_thread_decodes
    steps = [runner.append("steps", [t], 1)[0] for t in PROMPT[250:280]]
    assert torch.equal(torch.stack(steps), reference)
    assert runner.one_thread_decodes - before == 280 - KV_PAD  # the decodes of one past 256 cells

    held = 0
    for size in (7, 1, 33, 2, 1, 160, 47, 16, 11, 1, 1):  # pieces of every size, a last one of one
        out = runner.append("pieces", PROMPT[held : held + size], 1)
        held += size
    assert held == 280 and torch.equal(out[-1], reference[-1])


def test_long_and_short_sessions_in_one_forward_score_as_alone(runner: LlamaCppRunner) -> None:
    """A worker's step (and a draft's): long sessions of one and of several new rows beside a short one and
    beside each other, each bit for bit its own rows alone."""
    prompts = {"long1": PROMPT[:270], "long2": PROMPT[5:268], "short": PROMPT[:30]}
    news = {"long1": [7], "long2": [8, 9], "short": [13]}
    for name, prompt in prompts.items():
        runner.prefill(name, prompt, 1)
    items = [
        ForwardItem(name, len(prompts[name]), news[name], logits_at=list(range(len(news[name]))))
        for name in prompts
    ]
    out = runner.forward_each(items)
    for (name, prompt), logits in zip(prompts.items(), out):
        assert isinstance(logits, torch.Tensor)
        assert torch.equal(logits, runner.forward_full(prompt + news[name], len(news[name]))), name


def test_a_long_prompt_from_the_prompt_cache_and_its_tree_score_as_afresh(runner: LlamaCppRunner) -> None:
    """A session that starts with an ended one's long prompt takes its cells and decodes one token; a tree
    after a long prompt (a context of its own; a tree of one node: a decode of one) scores as its paths
    decoded afresh."""
    runner.prefill("first", PROMPT[:270] + [5, 6], 1)
    runner.free("first")
    cached = runner.reused_rows
    again = runner.prefill("second", PROMPT[:270] + [9], 1)
    assert runner.reused_rows - cached == 270
    tree = runner.forward([ForwardItem("second", 271, [21], parents=[270], logits_at=[0])])[0]
    runner.keep("second", range(272))
    nodes = runner.forward(
        [ForwardItem("second", 272, [31, 32, 33], parents=[271, 271, 272], logits_at=[0, 1, 2])]
    )[0]
    chain = runner.forward_full(PROMPT[:270] + [9, 21, 31, 33], 4)  # the path through the first child, afresh
    assert torch.equal(again[0], chain[0]) and torch.equal(tree[0], chain[1])
    assert torch.equal(nodes[0], chain[2]) and torch.equal(nodes[2], chain[3])


def test_without_one_thread_for_a_decode_of_one_the_rows_part(
    runner: LlamaCppRunner, monkeypatch: Any
) -> None:
    """The control: the same runner with its one-token decodes left on two threads gives other bits past 256
    cells — what made long prompts' greedy text differ by mode and seeded text by load."""
    monkeypatch.setattr(llama_cpp_runner, "KV_PAD", 10_000)
    reference = runner.forward_full(PROMPT[:280], 10)
    runner.prefill("steps", PROMPT[:270], 1)
    steps = torch.stack([runner.append("steps", [t], 1)[0] for t in PROMPT[270:280]])
    assert not torch.equal(steps, reference)


def test_a_tree_node_past_256_cells_of_its_context_scores_as_afresh(runner: LlamaCppRunner) -> None:
    """A chain of 250 rows (short) and a tree grown past 256 cells of its context, one node at a time: the
    node's decode of one is long by its context's cells, not by the chain's."""
    runner.prefill("grown", PROMPT[:250], 1)
    nodes = PROMPT[250:262]
    first = runner.forward(
        [ForwardItem("grown", 250, nodes[:10], parents=list(range(249, 259)), logits_at=[9])]
    )[0]
    before = runner.one_thread_decodes
    last = runner.forward([ForwardItem("grown", 260, nodes[10:11], parents=[259], logits_at=[0])])[0]
    path = runner.forward_full(PROMPT[:261], 2)
    assert torch.equal(first[0], path[0]) and torch.equal(last[0], path[1])
    assert runner.one_thread_decodes > before


def test_the_builtin_draft_scores_a_long_session_alike_token_by_token() -> None:
    """The built-in draft (Q4_0, whose weights llama.cpp repacks: other matmul kernels for a row alone than
    for several) on two threads: one token at a time past 256 cells, as in one forward."""
    from core.runners import load_runner

    draft = load_runner("builtin-draft", "llama.cpp", threads=THREADS, memory_cap_mb=256)
    try:
        reference = draft.forward_full(PROMPT[:280], 24)
        draft.prefill("steps", PROMPT[:256], 1)
        steps = [draft.append("steps", [t], 1)[0] for t in PROMPT[256:280]]
        assert torch.equal(torch.stack(steps), reference)
    finally:
        draft.free_all()


# the draft's repacked kernels too
@pytest.mark.parametrize("model", ["builtin", pytest.param("builtin-draft", marks=FULL_RUN)])
def test_a_long_decode_of_one_beside_a_throwaway_stream_scores_alike(model: str, monkeypatch: Any) -> None:
    """``pad stream`` (a worker or a draft from PAD_STREAM_FROM threads, forced here on two): a decode of one
    token past 256 cells goes on every thread beside a throwaway token in the next stream (or the one before)
    — two streams, the plain kernel — and scores bit for bit as in one forward; the sessions in those streams
    score as alone after it. Left alone on two threads (the control) the same decodes part."""
    from core.runners import load_runner

    runner = load_runner(model, "llama.cpp", threads=THREADS, memory_cap_mb=256)
    # two threads: one thread is the cheaper
    assert isinstance(runner, LlamaCppRunner) and runner.long_decode == "one-thread"
    runner.long_decode = "pad-stream"
    try:
        reference = runner.forward_full(PROMPT[:280], 24)
        short_reference = runner.forward_full(PROMPT[:48], 8)
        # sessions in streams on both sides of the long one: its throwaway tokens go into theirs, and leave
        # them as they were
        runner.prefill("before", PROMPT[:40], 1)
        runner.prefill("steps", PROMPT[:256], 1)
        runner.prefill("short", PROMPT[:40], 1)
        steps, shorts = [], []
        for i, token in enumerate(PROMPT[256:280]):
            items = [ForwardItem("steps", 256 + i, [token], logits_at=[0])]
            if i % 3 == 0:
                items.append(ForwardItem("short", 40 + i // 3, [PROMPT[40 + i // 3]], logits_at=[0]))
            out = runner.forward_each(items)
            steps.append(out[0][0])
            shorts += [out[1][0]] if i % 3 == 0 else []
        assert torch.equal(torch.stack(steps), reference)
        assert torch.equal(torch.stack(shorts), short_reference)
        assert runner.padded_decodes == 24 and runner.one_thread_decodes == 0
        again = torch.stack([runner.append("before", [t], 1)[0] for t in PROMPT[40:48]])
        assert torch.equal(again, short_reference)
        # the long session in the last stream:
        fresh = load_runner(model, "llama.cpp", threads=THREADS, memory_cap_mb=256)
        # its throwaway tokens go into the one before, first in the batch
        assert isinstance(fresh, LlamaCppRunner)
        fresh.long_decode = "pad-stream"
        try:
            for i in range(fresh.num_streams - 1):
                fresh.prefill(f"filler{i}", PROMPT[:40], 1)
            fresh.prefill("last", PROMPT[:256], 1)
            assert fresh._streams[-1].session_id == "last" and fresh.num_streams > 1
            last = torch.stack([fresh.append("last", [t], 1)[0] for t in PROMPT[256:280]])
            assert torch.equal(last, reference) and fresh.padded_decodes == 24
            filler = f"filler{fresh.num_streams - 2}"
            assert torch.equal(
                torch.stack([fresh.append(filler, [t], 1)[0] for t in PROMPT[40:48]]), short_reference
            )
        finally:
            fresh.close()
        # the control: decodes of one on two threads, alone
        monkeypatch.setattr(llama_cpp_runner, "KV_PAD", 10_000)
        padded = runner.padded_decodes
        runner.prefill("control", PROMPT[:270], 1)
        control = torch.stack([runner.append("control", [t], 1)[0] for t in PROMPT[270:280]])
        assert runner.padded_decodes == padded and not torch.equal(control, reference[-10:])
    finally:
        runner.free_all()
        runner.close()
