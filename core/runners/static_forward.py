"""A static forward for Llama-family decoders (Llama, Qwen2, Mistral without a sliding window): the model's own weights
as plain tensor ops over fixed-shape inputs, writing and reading the transformers runner's slot KV cache directly.

Every input of a step is a tensor whose shape is a bucket's (sessions padded to a bucket, new rows padded to a bucket,
the cells a row may see to a span bucket): the token ids, their positions, each session's slot, each row's cell, an
additive mask for any mix of chains and trees, the rows whose logits are kept. Padding sessions write the scratch slot,
padding rows their session's scratch cell; neither is ever seen by a real row. Nothing in ``step`` reads a value back to
the host or branches on one, so the same code that runs eagerly on the CPU (tested here) can be captured as one CUDA
graph per bucket on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

FAMILIES = ("llama", "qwen2", "mistral")  # config.model_type values whose decoder layer is the Llama layer


def static_problem(model: Any) -> str | None:
    """Why ``model`` cannot run the static forward (None: it can)."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"model_type {config.model_type!r} is not one of {FAMILIES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (the Llama MLP is silu)"
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", config.model_type == "mistral") and window < config.max_position_embeddings:
        return f"a sliding window of {window}"
    decoder = model.get_decoder()
    if any(not hasattr(layer, "self_attn") for layer in decoder.layers):
        return "a layer that is not a decoder layer (a pipeline stage's slice)"
    return None


@dataclass
class _Layer:
    in_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


def _bias(linear: Any) -> torch.Tensor | None:
    return linear.bias.detach() if getattr(linear, "bias", None) is not None else None


class StaticForward:
    """``hidden(...)``: the decoder's final hidden states of a step's rows, K/V of every row written into ``keys[i]`` /
    ``values[i]`` (one ``[slots, kv_heads, length, head_dim]`` store per layer, the runner's). ``logits(...)``: the kept
    rows' logits through the fp32 head."""

    def __init__(self, model: Any, keys: list[torch.Tensor], values: list[torch.Tensor], head_weight: torch.Tensor, head_bias: torch.Tensor | None) -> None:
        problem = static_problem(model)
        if problem is not None:
            raise ValueError(f"no static forward for this model: {problem}")
        config = model.config
        decoder = model.get_decoder()
        self.embed = decoder.embed_tokens.weight.detach()
        self.layers = []
        for layer in decoder.layers:
            attention, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                in_norm=layer.input_layernorm.weight.detach(),
                q=attention.q_proj.weight.detach(), k=attention.k_proj.weight.detach(), v=attention.v_proj.weight.detach(),
                q_bias=_bias(attention.q_proj), k_bias=_bias(attention.k_proj), v_bias=_bias(attention.v_proj),
                o=attention.o_proj.weight.detach(), o_bias=_bias(attention.o_proj),
                post_norm=layer.post_attention_layernorm.weight.detach(),
                gate=mlp.gate_proj.weight.detach(), up=mlp.up_proj.weight.detach(), down=mlp.down_proj.weight.detach(),
            ))
        self.norm = decoder.norm.weight.detach()
        self.eps = float(decoder.norm.variance_epsilon)
        self.rotary = decoder.rotary_emb
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.scaling = float(decoder.layers[0].self_attn.scaling)
        self.keys, self.values = keys, values
        self.head_weight, self.head_bias = head_weight, head_bias

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cells: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``tokens``, ``positions``, ``cells``: ``[B, W]``; ``slots``: ``[B]``; ``mask``: ``[B, W, S]`` additive (0 where a row
        sees the cell, the dtype's minimum where not), S the span of cells read. Returns ``[B, W, hidden]``."""
        batch, width = tokens.shape
        span = mask.shape[-1]
        states = F.embedding(tokens, self.embed)
        cos, sin = self.rotary(states, positions)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, W, D]: one rotation for every head
        rows = slots[:, None].expand(batch, width)
        attend = mask[:, None].to(states.dtype)
        for index, layer in enumerate(self.layers):
            normed = _rms(states, layer.in_norm, self.eps)
            q = F.linear(normed, layer.q, layer.q_bias).view(batch, width, self.heads, self.head_dim).transpose(1, 2)
            k = F.linear(normed, layer.k, layer.k_bias).view(batch, width, self.kv_heads, self.head_dim).transpose(1, 2)
            v = F.linear(normed, layer.v, layer.v_bias).view(batch, width, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            keys, values = self.keys[index], self.values[index]
            keys[rows, :, cells] = k.transpose(1, 2).to(keys.dtype)
            values[rows, :, cells] = v.transpose(1, 2).to(values.dtype)
            seen_k = keys.index_select(0, slots)[:, :, :span]
            seen_v = values.index_select(0, slots)[:, :, :span]
            if self.kv_heads != self.heads:
                seen_k = seen_k.repeat_interleave(self.heads // self.kv_heads, dim=1)
                seen_v = seen_v.repeat_interleave(self.heads // self.kv_heads, dim=1)
            attended = F.scaled_dot_product_attention(q, seen_k.to(q.dtype), seen_v.to(q.dtype), attn_mask=attend, scale=self.scaling)
            states = states + F.linear(attended.transpose(1, 2).reshape(batch, width, self.heads * self.head_dim), layer.o, layer.o_bias)
            normed = _rms(states, layer.post_norm, self.eps)
            states = states + F.linear(F.silu(F.linear(normed, layer.gate)) * F.linear(normed, layer.up), layer.down)
        return _rms(states, self.norm, self.eps)

    def logits(self, hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """The rows ``keep`` (flat indices into ``[B * W]``) of ``hidden`` through the head, in fp32: ``[K, vocab]``."""
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep).float()
        return F.linear(picked, self.head_weight, self.head_bias)


def _rms(states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm as transformers computes it: in fp32, scaled in the input's dtype."""
    dtype = states.dtype
    x = states.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def bucket(value: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding ``value``; ``value`` itself above the largest (the eager path)."""
    return next((b for b in buckets if b >= value), value)


GRAPH_SESSIONS = (1, 2, 4, 8, 16)  # the buckets captured at start-up (larger steps run eagerly)
GRAPH_ROWS = (1, 2, 4, 8, 16, 32)
GRAPH_SPANS = (256, 512, 1024, 2048)


@dataclass
class _Bucket:
    """A bucket's static buffers: its inputs, written in place before each run, and its output; its graph on CUDA."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    cells: torch.Tensor
    mask: torch.Tensor
    hidden: torch.Tensor | None = None
    graph: Any = None  # torch.cuda.CUDAGraph


class StepGraphs:
    """``StaticForward.hidden`` over static buffers, one set per bucket ``(sessions, rows, span)``: each run copies its inputs
    into the bucket's buffers and replays the bucket's CUDA graph (captured by ``capture``); on the CPU, or for a bucket not
    captured, the same buffers run eagerly. The hidden states returned are the bucket's output buffer: read them before the
    bucket's next run."""

    def __init__(self, forward: StaticForward, device: torch.device, dtype: torch.dtype) -> None:
        self.forward, self.device, self.dtype = forward, device, dtype
        self.buckets: dict[tuple[int, int, int], _Bucket] = {}
        self.capture_s = 0.0
        self.graph_bytes = 0
        self._pool: Any = None

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cells: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        key = (tokens.shape[0], tokens.shape[1], mask.shape[-1])
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = self._buffers(*key)
        bucket.tokens.copy_(tokens, non_blocking=True)
        bucket.positions.copy_(positions, non_blocking=True)
        bucket.slots.copy_(slots, non_blocking=True)
        bucket.cells.copy_(cells, non_blocking=True)
        bucket.mask.copy_(mask, non_blocking=True)
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            bucket.hidden = self.forward.hidden(bucket.tokens, bucket.positions, bucket.slots, bucket.cells, bucket.mask)
        assert bucket.hidden is not None
        return bucket.hidden

    def capture(self, scratch_slot: int, scratch_cell: int, progress: Any = None) -> None:
        """A CUDA graph for every bucket of GRAPH_SESSIONS × GRAPH_ROWS × GRAPH_SPANS that fits the cache (spans up to
        ``scratch_cell + 1``), each warmed up and captured over the scratch slot (no session's cell is written)."""
        import time

        if self.device.type != "cuda":
            return
        started = time.perf_counter()
        before = torch.cuda.memory_allocated(self.device)
        self._pool = torch.cuda.graph_pool_handle()
        keys = [(b, w, s) for s in GRAPH_SPANS if s <= scratch_cell + 1 for b in GRAPH_SESSIONS for w in GRAPH_ROWS]
        for done, key in enumerate(keys):
            bucket = self.buckets[key] = self._buffers(*key)
            bucket.slots.fill_(scratch_slot)
            bucket.cells.fill_(scratch_cell)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(2):  # warm-up: kernels chosen, workspaces allocated, before the capture
                    self.forward.hidden(bucket.tokens, bucket.positions, bucket.slots, bucket.cells, bucket.mask)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool), torch.inference_mode():
                bucket.hidden = self.forward.hidden(bucket.tokens, bucket.positions, bucket.slots, bucket.cells, bucket.mask)
            bucket.graph = graph
            if progress is not None and (done + 1) % 20 == 0:
                progress(f"captured {done + 1} of {len(keys)} step graphs")
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - started
        self.graph_bytes = torch.cuda.memory_allocated(self.device) - before

    def _buffers(self, sessions: int, rows: int, span: int) -> _Bucket:
        device = self.device
        return _Bucket(
            tokens=torch.zeros(sessions, rows, dtype=torch.long, device=device),
            positions=torch.zeros(sessions, rows, dtype=torch.long, device=device),
            slots=torch.zeros(sessions, dtype=torch.long, device=device),
            cells=torch.zeros(sessions, rows, dtype=torch.long, device=device),
            mask=torch.zeros(sessions, rows, span, dtype=self.dtype, device=device),
        )
