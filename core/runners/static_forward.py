"""A static forward for Llama-family decoders (Llama, Qwen2, Mistral without a sliding window): the model's
own weights as a few fused tensor ops over fixed-shape inputs, writing and reading a slot KV cache directly
(issue 60; issue 73's floor).

A step's inputs are integers only, padded to a bucket ``(sessions, rows, span)`` of ``BUCKETS``: per row its
token, position, the flat cell it writes, ``limit`` (it sees every cell below) and ``tree bits`` (the tree
cells above its session's ``tree base`` it sees: its ancestors and itself); per session its slot and tree
base. The attention mask is built from them on the device, once a step: nothing dense is built on the host.
Padding sessions write the scratch slot, padding rows their session's scratch cell (the slot's last); neither
is ever seen by a real row.

Per decoder layer (``tests/core/runners/test_static_forward.py`` counts them): one RMSNorm, one fused q/k/v
projection, the rotation of q and k in place (three ops), one write of the new K/V cells, one gather of the
cells ``[0, span)`` the step's sessions hold, q folded by KV head group (GQA with no repeated K/V), one
attention, the heads unfolded, the output projection and its residual in one ``addmm``, one RMSNorm, one fused
gate/up projection, SiLU and the product, the down projection and its residual in one ``addmm``: 16 ops.
Nothing in ``hidden`` reads a value back to the host or branches on one, so the same code runs eagerly on the
CPU (tested) and is captured as one CUDA graph per bucket on a GPU."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

FAMILIES = ("llama", "qwen2", "mistral")  # config.model_type values whose decoder layer is the Llama layer


@dataclass(frozen=True)
class Buckets:
    """The one table of step shapes (issue 73): what start-up captures on a GPU and what a step pads to. A
    step of at most ``sessions[-1]`` sessions of at most ``rows[-1]`` new rows replays a captured graph; a
    larger one runs eagerly, counted. Rows take the shapes a worker sees most (one, γ + 1 for γ = 4 and 16, a
    14-node tree with its new tokens) with little padding; spans grow fourfold (the cells a step reads are a
    small part of its time, graphs multiply with every span)."""

    sessions: tuple[int, ...] = (1, 2, 4, 8, 16)
    rows: tuple[int, ...] = (1, 2, 4, 6, 8, 12, 16, 18, 24, 32, 64)
    spans: tuple[int, ...] = (128, 512, 2048, 8192, 32768, 131072)

    def spans_for(self, cells: int) -> list[int]:
        """The span buckets of a session of at most ``cells`` cells: those below it, then ``cells`` itself."""
        return [s for s in self.spans if s < cells] + [cells]

    def key(self, batch: int, width: int, span: int, cells: int) -> tuple[int, int, int]:
        """The padded shape of a step of ``batch`` sessions, ``width`` new rows at most, rows seeing cells
        below ``span`` (≤ ``cells``, a session's most). Above the largest bucket a dimension keeps its size
        (sessions) or takes its next power of two (rows): an eager step."""
        sessions = bucket(batch, self.sessions)
        rows = bucket(width, self.rows) if width <= self.rows[-1] else 1 << (width - 1).bit_length()
        return sessions, rows, next(s for s in self.spans_for(cells) if s >= span)

    def captured(self, cells: int) -> list[tuple[int, int, int]]:
        """Every key start-up captures for sessions of at most ``cells`` cells."""
        return [(b, w, s) for s in self.spans_for(cells) for b in self.sessions for w in self.rows]


BUCKETS = Buckets()


def bucket(value: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding ``value``; ``value`` itself above the largest."""
    return next((b for b in buckets if b >= value), value)


def static_problem(model: Any) -> str | None:
    """Why ``model`` cannot run the static forward (None: it can)."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"model_type {config.model_type!r} is not one of {FAMILIES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (the Llama MLP is silu)"
    window = getattr(config, "sliding_window", None)
    if (
        window is not None
        and getattr(config, "use_sliding_window", config.model_type == "mistral")
        and window < config.max_position_embeddings
    ):
        return f"a sliding window of {window}"
    decoder = model.get_decoder()
    if any(not hasattr(layer, "self_attn") for layer in decoder.layers):
        return "a layer that is not a decoder layer (a pipeline stage's slice)"
    if getattr(config, "mlp_bias", False):
        return "an MLP with biases (mlp_bias)"
    rope = str(getattr(decoder.rotary_emb, "rope_type", "default"))
    if "dynamic" in rope or "longrope" in rope:
        return f"rope_type {rope!r} (its frequencies change with the length)"
    return None


@dataclass
class StepInputs:
    """A step's inputs on the device: views of one int64 buffer (``layout``)."""

    tokens: torch.Tensor  # [B, W]
    positions: torch.Tensor  # [B, W]
    write_at: torch.Tensor  # [B * W] flat cell (slot × slot_length + cell) each row's K/V goes to
    limit: torch.Tensor  # [B, W] a row sees every cell below
    tree_bits: torch.Tensor  # [B, W, words] bit j: the row sees cell tree_base + j
    tree_base: torch.Tensor  # [B]
    slots: torch.Tensor  # [B]


def input_words(sessions: int, rows: int) -> int:
    """int64 words of a step's inputs in a bucket of ``sessions`` × ``rows``."""
    return sessions * rows * (4 + tree_words(rows)) + 2 * sessions


def tree_words(rows: int) -> int:
    return max(1, -(-rows // 64))


def layout(buffer: torch.Tensor | np.ndarray, sessions: int, rows: int) -> list[Any]:
    """``buffer`` (``input_words`` long) cut into the inputs' views, in StepInputs' order."""
    n, words = sessions * rows, tree_words(rows)
    sizes = [n, n, n, n, n * words, sessions, sessions]
    shapes = [
        (sessions, rows),
        (sessions, rows),
        (n,),
        (sessions, rows),
        (sessions, rows, words),
        (sessions,),
        (sessions,),
    ]
    out, at = [], 0
    for size, shape in zip(sizes, shapes):
        out.append(buffer[at : at + size].reshape(shape))
        at += size
    return out


@dataclass
class _Layer:
    in_norm: torch.Tensor
    qkv: torch.Tensor  # [(heads + 2 kv_heads) × head_dim, hidden]: q, k and v fused
    qkv_bias: torch.Tensor | None
    o_t: torch.Tensor  # [heads × head_dim, hidden] (o_proj's weight, transposed view)
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 × intermediate, hidden]: gate and up fused
    down_t: torch.Tensor  # [intermediate, hidden]
    store: torch.Tensor  # this layer's KV cells [slots × length, 2 × kv_heads × head_dim]


def kv_store(
    slots: int, length: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """One layer's KV cells for the static forward: ``[slots, length, 2, kv_heads, head_dim]`` (a cell's K
    beside its V)."""
    return torch.empty(slots, length, 2, kv_heads, head_dim, dtype=dtype, device=device)


def _fuse(linears: list[Any]) -> torch.Tensor:
    """The weights of ``linears`` concatenated by rows; each module's weight then a view of it (no second copy
    kept)."""
    fused = torch.cat([linear.weight.detach() for linear in linears])
    at = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = torch.nn.Parameter(fused[at : at + rows], requires_grad=False)
        at += rows
    return fused


def _bias(linear: Any) -> torch.Tensor | None:
    bias = getattr(linear, "bias", None)
    return bias.detach() if bias is not None else None


def _fused_bias(linears: list[Any]) -> torch.Tensor | None:
    biases = [getattr(linear, "bias", None) for linear in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat(
        [
            b.detach()
            if b is not None
            else torch.zeros(lin.weight.shape[0], dtype=lin.weight.dtype, device=lin.weight.device)
            for b, lin in zip(biases, linears)
        ]
    )


class StaticForward:
    """``hidden(inputs, span)``: the decoder's final hidden states ``[B × W, hidden]`` of a step's rows, K/V
    of every row written into its cell of ``stores[i]`` (``kv_store``). ``logits(hidden, keep)``: the kept
    rows through the fp32 head."""

    def __init__(
        self,
        model: Any,
        stores: list[torch.Tensor],
        head_weight: torch.Tensor,
        head_bias: torch.Tensor | None,
        length: int,
    ) -> None:
        problem = static_problem(model)
        if problem is not None:
            raise ValueError(f"no static forward for this model: {problem}")
        config = model.config
        decoder = model.get_decoder()
        self.embed = decoder.embed_tokens.weight.detach()
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.group = self.heads // self.kv_heads
        self.hidden_size = int(config.hidden_size)
        self.length = length
        self.layers = []
        for layer, store in zip(decoder.layers, stores):
            attention, mlp = layer.self_attn, layer.mlp
            projections = [attention.q_proj, attention.k_proj, attention.v_proj]
            self.layers.append(
                _Layer(
                    in_norm=layer.input_layernorm.weight.detach(),
                    qkv=_fuse(projections),
                    qkv_bias=_fused_bias(projections),
                    o_t=attention.o_proj.weight.detach().t(),
                    o_bias=_bias(attention.o_proj),
                    post_norm=layer.post_attention_layernorm.weight.detach(),
                    gate_up=_fuse([mlp.gate_proj, mlp.up_proj]),
                    down_t=mlp.down_proj.weight.detach().t(),
                    store=store.view(-1, 2 * self.kv_heads * self.head_dim),
                )
            )
        self.stores = stores
        self.norm = decoder.norm.weight.detach()
        self.eps = float(decoder.norm.variance_epsilon)
        self.scaling = float(decoder.layers[0].self_attn.scaling)
        self.head_weight, self.head_bias = head_weight, head_bias
        # [length, 2, head_dim]: cos, signed sin
        self.rotation = _rotation_table(decoder.rotary_emb, length, self.embed)
        self.cells = torch.arange(length, device=self.embed.device)

    def hidden(self, x: StepInputs, span: int) -> torch.Tensor:
        batch, width = x.tokens.shape
        n, heads, kv, group, dim = batch * width, self.heads, self.kv_heads, self.group, self.head_dim
        qk_width, q_width = (heads + kv) * dim, heads * dim
        states = F.embedding(x.tokens.view(n), self.embed)
        turn = self.rotation.index_select(0, x.positions.view(n))
        cos, sin = turn[:, None, 0], turn[:, None, 1]  # [N, 1, D]: one rotation for every head
        mask = self._mask(x, span, batch, width)
        for layer in self.layers:
            normed = F.rms_norm(states, (self.hidden_size,), layer.in_norm, self.eps)
            qkv = F.linear(normed, layer.qkv, layer.qkv_bias)  # [N, (H + 2 KV) × D]
            qk = qkv[:, :qk_width].view(n, heads + kv, dim)
            # rotate_half(x) · sin = roll(x) · (−sin | sin)
            torch.addcmul(qk * cos, qk.roll(dim // 2, -1), sin, out=qk)
            # the rows' K (rotated) and V, side by side
            layer.store.index_copy_(0, x.write_at, qkv[:, q_width:])
            # [B, S, 2, KV, D]
            seen = layer.store.view(-1, self.length, 2, kv, dim)[:, :span].index_select(0, x.slots)
            keys, values = seen[:, :, 0].transpose(1, 2), seen[:, :, 1].transpose(1, 2)  # [B, KV, S, D]
            q = (
                qkv[:, :q_width]
                .view(batch, width, kv, group, dim)
                .permute(0, 2, 3, 1, 4)
                .reshape(batch, kv, group * width, dim)
            )
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)
            attended = attended.view(batch, kv, group, width, dim).permute(0, 3, 1, 2, 4).reshape(n, q_width)
            states = torch.addmm(
                states if layer.o_bias is None else states + layer.o_bias, attended, layer.o_t
            )
            normed = F.rms_norm(states, (self.hidden_size,), layer.post_norm, self.eps)
            gate_up = F.linear(normed, layer.gate_up)
            half = gate_up.shape[-1] // 2
            states = torch.addmm(states, F.silu(gate_up[:, :half]) * gate_up[:, half:], layer.down_t)
        return F.rms_norm(states, (self.hidden_size,), self.norm, self.eps)

    def _mask(self, x: StepInputs, span: int, batch: int, width: int) -> torch.Tensor:
        """``[B, 1, group × W, S]`` bool from the step's limits and tree bits, built on the device (once a
        step)."""
        cells = self.cells[:span]
        words = x.tree_bits.shape[-1]
        visible = cells.view(1, 1, span) < x.limit.view(batch, width, 1)
        # [B, S]: a cell's place after its session's tree base
        rel = cells.view(1, span) - x.tree_base.view(batch, 1)
        inside = (rel >= 0) & (rel < 64 * words)
        rel = rel.clamp(0, 64 * words - 1)
        if words == 1:
            word = x.tree_bits
        else:
            word = x.tree_bits.gather(2, (rel >> 6).view(batch, 1, span).expand(batch, width, span))
        seen = ((word >> (rel & 63).view(batch, 1, span)) & 1).bool() & inside.view(batch, 1, span)
        visible = visible | seen
        return (
            visible.view(batch, 1, 1, width, span)
            .expand(batch, 1, self.group, width, span)
            .reshape(batch, 1, self.group * width, span)
        )

    def logits(self, hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """The rows ``keep`` (flat indices into ``[B × W]``) of ``hidden`` through the head, in fp32: ``[K,
        vocab]``."""
        return F.linear(hidden.index_select(0, keep).float(), self.head_weight, self.head_bias)


def _rotation_table(rotary: Any, length: int, like: torch.Tensor) -> torch.Tensor:
    """cos and the signed sin (−sin on the first half: ``rotate_half(x) · sin = roll(x) · signed``) of every
    position below ``length``, in the model's dtype, as transformers' rotary embedding gives them."""
    positions = torch.arange(length, device=like.device)[None]
    with torch.no_grad():
        cos, sin = rotary(like[:1][None], positions)
    cos, sin = cos[0], sin[0]
    half = cos.shape[-1] // 2
    signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    return torch.stack([cos, signed], dim=1).contiguous()


@dataclass
class _Bucket:
    """A captured key's buffers: its inputs (one int64 buffer the step's inputs are copied into) and its
    output; its graph on CUDA."""

    inputs: torch.Tensor
    views: StepInputs
    hidden: torch.Tensor | None = None
    graph: Any = None  # torch.cuda.CUDAGraph


@dataclass
class GraphCounts:
    steps: int = 0  # forwards run
    eager: int = 0  # of them, outside every captured key (on a GPU: no graph to replay)
    # forwards per key (tests: the coverage)
    keys: dict[tuple[int, int, int], int] = field(default_factory=dict)

    def eager_keys(self, planned: set[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        return sorted(key for key in self.keys if key not in planned)


class StepGraphs:
    """``StaticForward.hidden`` by bucket: a step whose key is one start-up captures copies its inputs into
    that key's buffers and replays its CUDA graph (on the CPU, the same buffers run eagerly); any other step
    runs eagerly on its own inputs, keeps nothing and is counted (``counts.eager``). The hidden states
    returned are a key's output buffer: read them before its next run."""

    def __init__(
        self, forward: StaticForward, device: torch.device, slot_length: int, buckets: Buckets = BUCKETS
    ) -> None:
        self.forward, self.device, self.slot_length, self.table = forward, device, slot_length, buckets
        self.cells = slot_length - 1  # a session's cells at most (the last is the scratch cell)
        self.planned = set(buckets.captured(self.cells))
        self.buckets: dict[tuple[int, int, int], _Bucket] = {}
        self.counts = GraphCounts()
        self.capture_s = 0.0
        self.graph_bytes = 0
        self._pool: Any = None

    def key(self, batch: int, width: int, span: int) -> tuple[int, int, int]:
        return self.table.key(batch, width, span, self.cells)

    def run(self, key: tuple[int, int, int], inputs: torch.Tensor) -> torch.Tensor:
        """The hidden states ``[B × W, hidden]`` of the step whose inputs (``input_words(B, W)``, on the
        device) are ``inputs``. A captured key's are its graph's output, in the pool every graph shares: read
        them before the next replay of any."""
        sessions, rows, span = key
        self.counts.steps += 1
        self.counts.keys[key] = self.counts.keys.get(key, 0) + 1
        if key not in self.planned:
            self.counts.eager += 1
            with attention_backend(self.device):
                return self.forward.hidden(StepInputs(*layout(inputs, sessions, rows)), span)
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = self._buffers(key)
        bucket.inputs.copy_(inputs)
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            with attention_backend(self.device):
                bucket.hidden = self.forward.hidden(bucket.views, span)
        assert bucket.hidden is not None
        return bucket.hidden

    def capture(self, scratch_slot: int, progress: Callable[[str], None] | None = None) -> None:
        """A CUDA graph for every planned key, each warmed up and captured over the scratch slot (no session's
        cell is written)."""
        if self.device.type != "cuda":
            return
        started = time.perf_counter()
        before = torch.cuda.memory_allocated(self.device)
        self._pool = torch.cuda.graph_pool_handle()
        # the largest first: the pool grows once
        keys = sorted(self.planned, key=lambda k: (-k[2], -k[0] * k[1]))
        for done, key in enumerate(keys):
            bucket = self.buckets[key] = self._buffers(key)
            _scratch_inputs(bucket.views, scratch_slot, self.slot_length)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), torch.inference_mode(), attention_backend(self.device):
                for _ in range(2):  # warm-up: kernels chosen, workspaces allocated, before the capture
                    self.forward.hidden(bucket.views, key[2])
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with (
                torch.cuda.graph(graph, pool=self._pool),
                torch.inference_mode(),
                attention_backend(self.device),
            ):
                bucket.hidden = self.forward.hidden(bucket.views, key[2])
            bucket.graph = graph
            if progress is not None and ((done + 1) % 50 == 0 or done + 1 == len(keys)):
                progress(f"captured {done + 1} of {len(keys)} step graphs")
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - started
        self.graph_bytes = torch.cuda.memory_allocated(self.device) - before

    def _buffers(self, key: tuple[int, int, int]) -> _Bucket:
        sessions, rows, _ = key
        with torch.inference_mode(False):  # made inside a step's forward, still writable by the next
            inputs = torch.zeros(input_words(sessions, rows), dtype=torch.int64, device=self.device)
        return _Bucket(inputs, StepInputs(*layout(inputs, sessions, rows)))


def attention_backend(device: torch.device) -> Any:
    """On CUDA, scaled_dot_product_attention held to its memory-efficient kernel (a mask, any K/V strides;
    math where it cannot): cuDNN's, which PyTorch may prefer on Hopper, builds a graph of its own for each of
    the ~165 shapes at start-up. Elsewhere the backend PyTorch picks."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _scratch_inputs(views: StepInputs, scratch_slot: int, slot_length: int) -> None:
    """Inputs that touch only the scratch slot: every row writes its scratch cell and sees its cell 0
    (zeros)."""
    views.slots.fill_(scratch_slot)
    views.write_at.fill_(scratch_slot * slot_length + slot_length - 1)
    views.limit.fill_(1)
    views.tree_base.fill_(slot_length)


def step_inputs(
    host: np.ndarray,
    key: tuple[int, int, int],
    sessions: list[tuple[Any, int, int]],
    scratch_slot: int,
    slot_length: int,
) -> None:
    """Fill ``host`` (``input_words`` int64 words) with a step's inputs: ``sessions`` are (rows, first new
    row, slot) of each real session (``core.runners.base.Rows``); the rest of the bucket is padding. Numpy
    over each session's new rows; Python only over tree rows (their ancestor bits)."""
    size_b, size_w, _ = key
    tokens, positions, write_at, limit, tree_bits, tree_base, slots = layout(host, size_b, size_w)
    scratch = slot_length - 1
    tokens[:] = 0
    positions[:] = 0
    tree_bits[:] = 0
    slots[:] = scratch_slot
    tree_base[:] = slot_length
    write_at[:] = scratch_slot * slot_length + scratch
    limit[:] = 1
    cells_w = write_at.reshape(size_b, size_w)
    for b, (rows, first, slot) in enumerate(sessions):
        total, chain = len(rows), rows.chain
        count = total - first
        cells = np.arange(first, total)
        tokens[b, :count] = rows.tokens[first:]
        positions[b, :count] = rows.depths[first:]
        cells_w[b, :count] = slot * slot_length + cells
        cells_w[b, count:] = slot * slot_length + scratch
        slots[b] = slot
        tree_base[b] = chain
        # a padding row sees the held cells (or the first new one): never nothing (NaN)
        limit[b, count:] = max(first, 1)
        if chain >= total:
            limit[b, :count] = cells + 1
            continue
        limit[b, : max(chain - first, 0)] = cells[: max(chain - first, 0)] + 1
        bits: dict[int, int] = {}
        entry: dict[int, int] = {}  # a tree row's way into the chain: the chain row its path leaves by
        for r in range(chain, total):
            parent = rows.parents[r]
            bits[r] = (bits[parent] if parent >= chain else 0) | (1 << (r - chain))
            entry[r] = entry[parent] if parent >= chain else parent
            limit[b, r - first] = entry[r] + 1
            value = bits[r]
            for word in range(tree_bits.shape[-1]):
                part = (value >> (64 * word)) & 0xFFFFFFFFFFFFFFFF
                tree_bits[b, r - first, word] = part - (1 << 64) if part >= 1 << 63 else part
