"""The ``transformers`` backend (docs/design.md §7, §9): HF checkpoints or GGUF files, on CPU or CUDA.

The KV cache is a preallocated slot cache, per layer ``[slots, kv_heads, length, head_dim]``:
a session holds a slot (lent least recently used first), row ``r`` in cell ``r``. One forward
pads every session's new rows to one width; an additive float mask lets each row see its
ancestors' cells only (chains, trees and batches alike), with ``position_ids`` = depth.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.errors import ModelLoadError, SessionShort
from core.math.tree import path_of
from core.names import Backend
from core.runners.base import ModelRunner, Place, Rows, RunnerInfo, Staged, held_by, in_turns, lend
from core.runners.models import ModelSource, cache_dir, cache_lock, file_key, save_to_cache
from core.runners.tokenizer import eos_ids

log = logging.getLogger(__name__)

MAX_SLOTS = 256  # sessions held in the cache at most
# the model's forward: transformers' modules, or core.runners.static_forward (auto: static on CUDA where the
# model allows)
FORWARDS = ("auto", "hf", "static")


def resolve_device(device: str) -> torch.device:
    """``auto``: CUDA when present, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(
            f"device {device!r} asked for, but torch sees no CUDA device (use --device cpu or auto)"
        )
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on a GPU that has it, else float32."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ModelLoadError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    return getattr(torch, dtype)  # type: ignore[no-any-return]


@dataclass
class _Slot(Place):
    index: int = 0
    clean: bool = False  # written once with finite values (a masked cell must not hold NaN)


class TransformersRunner(ModelRunner):
    def __init__(
        self,
        source: ModelSource,
        tokenizer: Any,
        max_context: int = 2048,
        device: str = "cpu",
        model: Any = None,
        dtype: str = "float32",
        memory_cap_mb: int = 1024,
        gpu_memory_utilization: float = 0.9,
        layers: tuple[int, int] | None = None,
        forward: str = "auto",
    ) -> None:
        """``model``: a built model to run instead of loading ``source``. The slots fill ``memory_cap_mb`` on
        the CPU, on a GPU ``gpu_memory_utilization`` of its memory less what is used (vLLM's rule).
        ``layers``: a stage's ``[first, end)``. ``forward``: one of FORWARDS."""
        super().__init__()
        self.tokenizer = tokenizer
        self.device = resolve_device(device)
        owned = model is None
        if model is None:
            model = _load_model(source, len(tokenizer)).to(resolve_dtype(dtype, self.device))
        num_layers = int(model.config.num_hidden_layers)
        if layers is not None:
            first, end = layers
            if not 0 <= first < end <= num_layers:
                raise ModelLoadError(
                    f"layers {first}:{end} are not a slice of the model's {num_layers} layers "
                    f"(0:{num_layers} is all of them)"
                )
            if (first, end) != (0, num_layers):
                self.layer_range = (first, end)
                if owned:
                    _drop_other_layers(model, first, end)
        self.keeps_subtrees = True  # the slot cache gathers any kept rows
        self.model = _fp32_rotary(model.to(self.device).eval())
        config = self.model.config
        self.info = RunnerInfo(
            model_id=source.name,
            backend=Backend.TRANSFORMERS.value,
            vocab_size=int(config.vocab_size),
            max_context=min(max_context, int(config.max_position_embeddings)),
            eos_ids=eos_ids(tokenizer),
        )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.dtype = self.model.dtype
        elem = torch.finfo(self.dtype).bits // 8
        self._first_layer, self._end_layer = self.layer_range or (0, num_layers)
        self.hidden_size = int(config.hidden_size)
        self.num_layers = num_layers
        self._kv_bytes = 2 * (self._end_layer - self._first_layer) * kv_heads * head_dim * elem
        self.slot_length = self.info.max_context + 1  # + one scratch cell that padding writes
        slot_bytes = self.slot_length * self._kv_bytes
        if self.device.type == "cuda":
            gc.collect()
            # what PyTorch holds cached for runners gone is free: not counted as used
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * gpu_memory_utilization) - (total - free)
        else:
            budget = memory_cap_mb * 2**20
        self.num_slots = max(1, min(MAX_SLOTS, budget // slot_bytes))
        if budget // slot_bytes < 2:
            log.warning(
                "the KV cache holds %d session(s) of %d cells: %.0f MB asked for, %.0f MB a "
                "session (raise --gpu-memory-utilization or --memory-cap-mb, "
                "or lower --max-context)",
                self.num_slots,
                self.slot_length,
                max(budget, 0) / 2**20,
                slot_bytes / 2**20,
            )
        self.forward_kind = _forward_kind(forward, model, self.device, self.layer_range)
        held = self._end_layer - self._first_layer  # the layers this runner holds
        self._static = self._graphs = self.upload = None
        if self.forward_kind == "static":
            from core.runners.static_forward import kv_store

            # one store per layer, [slots + 1, length, 2, kv_heads, head_dim]: a cell's K beside its V; slot
            # ``num_slots`` is the scratch slot that padding sessions use (zeroed once: its cell 0 is what a
            # padding row sees)
            self._stores = [
                kv_store(self.num_slots + 1, self.slot_length, kv_heads, head_dim, self.dtype, self.device)
                for _ in range(held)
            ]
            self._cell_dim = 0  # a slot's cells: dim 0 of its [length, 2, kv_heads, head_dim]
            for store in self._stores:
                store[self.num_slots].zero_()
        else:
            # one K and one V store per layer of this runner, [slots, kv_heads, length, head_dim]: layer ``i``
            # (absolute) writes ``_keys[i − first]``; empty: a slot's pages are touched (and zeroed) when it
            # is first lent
            self._keys = [
                torch.empty(
                    self.num_slots, kv_heads, self.slot_length, head_dim, dtype=self.dtype, device=self.device
                )
                for _ in range(held)
            ]
            self._values = [
                torch.empty(
                    self.num_slots, kv_heads, self.slot_length, head_dim, dtype=self.dtype, device=self.device
                )
                for _ in range(held)
            ]
            self._stores = [*self._keys, *self._values]
            self._cell_dim = 1  # a slot's cells: dim 1 of its [kv_heads, length, head_dim]
        self._slots = [_Slot(index=i) for i in range(self.num_slots)]
        self._clock = 0
        self._decoder = self.model.get_decoder()
        self._head_weight = self._head_bias = None
        if self.is_last_stage:
            head = self.model.get_output_embeddings()
            # the LM head in fp32 whatever the model's dtype: bf16 logits are rounded to 1/16–1/8 at
            # their usual size, enough to flip an argmax (measured: 4 % of positions on the built-in)
            self._head_weight = head.weight.detach().float()
            self._head_bias = head.bias.detach().float() if getattr(head, "bias", None) is not None else None
        if self.forward_kind == "static":
            from core.runners.static_forward import StaticForward, StepGraphs
            from core.runners.step_upload import StepUpload

            assert self._head_weight is not None
            self._static = StaticForward(
                self.model, self._stores, self._head_weight, self._head_bias, self.slot_length
            )
            self._graphs = StepGraphs(self._static, self.device, self.slot_length)
            self.upload = StepUpload(self.device)
            if self.device.type == "cuda":
                log.info(
                    "capturing the static forward's step graphs (%d slots of %d cells)",
                    self.num_slots,
                    self.slot_length,
                )
                self._graphs.capture(self.num_slots, progress=log.info)
                log.info(
                    "captured %d step graphs in %.1f s (%.0f MB)",
                    len(self._graphs.buckets),
                    self._graphs.capture_s,
                    self._graphs.graph_bytes / 2**20,
                )

    def step_info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"forward": self.forward_kind}
        if self._graphs is not None:
            graphs = self._graphs
            captured = sum(b.graph is not None for b in graphs.buckets.values())
            out |= {
                "graphs": captured,
                "capture_s": round(graphs.capture_s, 3),
                "graph_mb": round(graphs.graph_bytes / 2**20, 1),
                "forwards": graphs.counts.steps,
                "eager_forwards": graphs.counts.eager,
            }
        return out

    @property
    def is_last_stage(self) -> bool:
        return self._end_layer == int(self.model.config.num_hidden_layers)

    def _compute_each(self, work: list[Staged]) -> list[torch.Tensor | Exception]:
        out: list[torch.Tensor | Exception | None] = [self._missing_input(w) for w in work]
        return in_turns(
            work, out, [i for i, o in enumerate(out) if o is None], self.num_slots, self._forward_slots
        )

    def _missing_input(self, work: Staged) -> Exception | None:
        """A later stage cannot recompute rows it lost (it has only the new rows' states): the pipeline must
        resend them."""
        if self.is_first_stage:
            return None
        if work.hidden is None:
            return ValueError(
                f"a stage of layers {self._first_layer}:{self._end_layer} takes hidden states, not tokens"
            )
        slot = held_by(self._slots, work.session_id)
        cached = slot.rows if slot is not None else 0
        if cached < work.start:
            return SessionShort(
                work.session_id,
                cached,
                f"the stage of layers {self._first_layer}:{self._end_layer} lost its rows past {cached}",
            )
        return None

    @torch.inference_mode()
    def _forward_slots(self, work: list[Staged], busy: set[str] | None = None) -> list[torch.Tensor]:
        """One model forward over the new rows of every item (one session each); on the static forward, an
        item ``alone`` gets a forward of its own (its buckets its own: its numbers do not depend on what else
        the step holds). ``busy``: the step's sessions, whose slots stay theirs."""
        busy = busy if busy is not None else {x.session_id for x in work}
        if self._static is not None:
            return self._static_step(work, busy)
        self._clock += 1
        slots = [self._slot_for(w.session_id, busy) for w in work]
        firsts = [min(slot.rows, w.start) for w, slot in zip(work, slots)]
        counts = [len(w.rows) - first for w, first in zip(work, firsts)]
        width, span = max(counts), max(len(w.rows) for w in work)
        batch = len(work)
        tokens = torch.zeros(batch, width, dtype=torch.long)
        positions = torch.zeros(batch, width, dtype=torch.long)
        # padding writes the scratch cell
        cells = torch.full((batch, width), self.slot_length - 1, dtype=torch.long)
        visible = torch.zeros(batch, width, span, dtype=torch.bool)
        visible[:, :, 0] = True  # a padding row sees cell 0 (a row that sees nothing gives NaN)
        for b, (w, first, count) in enumerate(zip(work, firsts, counts)):
            rows = w.rows
            tokens[b, :count] = torch.tensor(rows.tokens[first:], dtype=torch.long)
            positions[b, :count] = torch.tensor(rows.depths[first:], dtype=torch.long)
            cells[b, :count] = torch.arange(first, len(rows))
            for i, row in enumerate(range(first, len(rows))):
                if row < rows.chain:
                    visible[b, i, : row + 1] = True
                else:
                    visible[b, i, 0] = False
                    visible[b, i, path_of(row, rows.parents)] = True  # its ancestors and itself
        mask = _additive(visible, self.dtype)
        view = _SlotView(
            self, torch.tensor([s.index for s in slots], device=self.device), cells.to(self.device), span
        )
        try:
            if self.layer_range is None:
                hidden = self._decoder(
                    input_ids=tokens.to(self.device),
                    attention_mask=mask[:, None].to(self.device),
                    position_ids=positions.to(self.device),
                    use_cache=True,
                    **{_cache_kwarg(self._decoder.forward): view},
                ).last_hidden_state
            else:
                hidden = self._stage_layers(work, firsts, counts, tokens, positions, mask, view)
        except BaseException:
            for slot in slots:
                self._release(slot)
            raise
        for w, slot in zip(work, slots):
            slot.rows, slot.clean = len(w.rows), True
        if not self.is_last_stage:  # the new rows' states, for the next stage
            return [
                hidden[b, w.start - first : count].cpu()
                for b, (w, first, count) in enumerate(zip(work, firsts, counts))
            ]
        index = torch.tensor(
            [b * width + r - first for b, (w, first) in enumerate(zip(work, firsts)) for r in w.logits_rows],
            device=self.device,
        )
        picked = hidden.reshape(batch * width, -1).index_select(0, index).float()
        logits = self._to_caller(torch.nn.functional.linear(picked, self._head_weight, self._head_bias))
        return list(logits.split([len(w.logits_rows) for w in work]))

    def _static_step(self, work: list[Staged], busy: set[str]) -> list[torch.Tensor]:
        """The step on the static forward: each item ``alone`` a forward of its own (its bucket its own: its
        numbers do not depend on what else the step holds), the others forwards of at most the largest
        bucket's sessions; every forward's inputs prepared on the host, padded to its bucket
        (core.runners.static_forward.step_inputs), and sent with whatever else the step brings in the step's
        one upload; then each forward (a graph's replay on a GPU) and the head on its kept rows."""
        assert self._static is not None and self._graphs is not None and self.upload is not None
        from core.runners.static_forward import BUCKETS, input_words, step_inputs

        shared = [w for w in work if not w.alone]
        # more sessions than the largest bucket: forwards of at most that many, each a graph's replay
        most = BUCKETS.sessions[-1]
        groups = (
            [[w] for w in work if w.alone] + [shared[i : i + most] for i in range(0, len(shared), most)]
            if len(work) > 1
            else [work]
        )
        self._clock += 1
        upload = self.upload
        owned = not upload.in_step  # else the worker's step began it, with its own numbers in it, and ends it
        if owned:
            upload.begin()
        lent: list[_Slot] = []
        plans = []
        try:
            for group in groups:
                slots = [self._slot_for(w.session_id, busy) for w in group]
                lent += slots
                # a session with tree rows forwards every tree row again (its rows' ancestors are then all new
                # rows or chain rows)
                firsts = [
                    min(slot.rows, w.start, w.rows.chain if w.rows.chain < len(w.rows) else w.start)
                    for w, slot in zip(group, slots)
                ]
                width, span = (
                    max(len(w.rows) - first for w, first in zip(group, firsts)),
                    max(len(w.rows) for w in group),
                )
                key = self._graphs.key(len(group), width, span)
                inputs, host = upload.reserve(input_words(key[0], key[1]))
                step_inputs(
                    host,
                    key,
                    [(w.rows, first, slot.index) for w, first, slot in zip(group, firsts, slots)],
                    self.num_slots,
                    self.slot_length,
                )
                keep = upload.add_ints(
                    [
                        b * key[1] + r - first
                        for b, (w, first) in enumerate(zip(group, firsts))
                        for r in w.logits_rows
                    ]
                )
                plans.append((group, slots, key, inputs, keep))
            upload.send()
            done: dict[int, torch.Tensor] = {}
            for group, slots, key, inputs, keep in plans:
                hidden = self._graphs.run(key, upload.view(inputs))
                logits = self._to_caller(self._static.logits(hidden, upload.view(keep)))
                for w, slot, rows in zip(group, slots, logits.split([len(w.logits_rows) for w in group])):
                    slot.rows, slot.clean = len(w.rows), True
                    done[id(w)] = rows
        except BaseException:
            for slot in lent:
                self._release(slot)
            raise
        finally:
            if owned:
                upload.end()
        return [done[id(w)] for w in work]

    def _to_caller(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's logits on the host, or where they are when the caller scores them there
        (``logits_on_device``)."""
        return logits if self.logits_on_device else logits.cpu()

    def _stage_layers(
        self,
        work: list[Staged],
        firsts: list[int],
        counts: list[int],
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        view: _SlotView,
    ) -> torch.Tensor:
        """This stage's layers over the batch (research/tree-and-pipeline.md §4.1), from tokens or the states
        sent."""
        decoder = self._decoder
        if self.is_first_stage:
            states = decoder.embed_tokens(tokens.to(self.device))
        else:
            states = torch.zeros(
                len(work), tokens.shape[1], self.hidden_size, dtype=self.dtype, device=self.device
            )
            for b, (w, count) in enumerate(zip(work, counts)):
                assert w.hidden is not None and firsts[b] == w.start  # _missing_input checked both
                states[b, :count] = w.hidden.to(self.device, self.dtype)
        position_ids = positions.to(self.device)
        attention = mask[:, None].to(self.device)
        rotary = decoder.rotary_emb(states, position_ids=position_ids)
        layers = decoder.layers[self._first_layer : self._end_layer]
        cache = {_cache_kwarg(layers[0].forward): view} if len(layers) else {}
        for layer in layers:
            states = layer(
                states,
                attention_mask=attention,
                position_ids=position_ids,
                use_cache=True,
                position_embeddings=rotary,
                **cache,
            )
        return decoder.norm(states) if self.is_last_stage else states

    def is_full(self, chains: Collection[str], trees: Collection[str], tree: bool = False) -> bool:
        return self.places_held(chains, trees) >= self.num_slots

    @property
    def session_places(self) -> int:
        return self.num_slots

    def _slot_for(self, session_id: str, busy: set[str]) -> _Slot:
        slot, fresh = lend(self._slots, session_id, busy, self._release)
        if fresh and not slot.clean:
            for store in self._stores:
                store[slot.index].zero_()
            slot.clean = True
        slot.last_used = self._clock
        return slot

    def _release(self, slot: _Slot) -> None:
        slot.session_id, slot.rows = None, 0

    def _keep_cache(self, session_id: str, rows: Rows, kept: Sequence[int]) -> None:
        slot = held_by(self._slots, session_id)
        if slot is None:
            return
        if isinstance(kept, range):  # a prefix: its cells are in place
            slot.rows = min(slot.rows, len(kept))
            return
        cached = [r for r in kept if r < slot.rows]  # a path's rows increase: a prefix of it
        if cached != list(range(len(cached))):
            if self.upload is not None and self.upload.in_step:
                # the index in the step's upload, the move right after it lands
                upload, at, where = self.upload, self.upload.add_ints(cached), slot.index
                upload.after_send(lambda: self._move_cells(where, upload.view(at)))
            else:
                self._move_cells(slot.index, torch.tensor(cached, dtype=torch.long, device=self.device))
        slot.rows = len(cached)

    def _move_cells(self, slot: int, index: torch.Tensor) -> None:
        """The slot's cells ``index`` (increasing) moved to its first ``len(index)`` cells."""
        for store in self._stores:
            store[slot].narrow(self._cell_dim, 0, index.numel()).copy_(
                store[slot].index_select(self._cell_dim, index)
            )

    def _free_cache(self, session_id: str) -> None:
        slot = held_by(self._slots, session_id)
        if slot is not None:
            self._release(slot)

    @torch.inference_mode()
    def forward_full(self, tokens: list[int], num_logits: int) -> torch.Tensor:
        if self.layer_range is not None:
            raise ValueError(
                f"a stage of layers {self._first_layer}:{self._end_layer} has no sessionless forward"
            )
        input_ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        out = self.model(input_ids=input_ids, use_cache=False)
        return out.logits[0, -num_logits:].float().cpu()


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean ``visible`` as an additive attention mask: 0 where a row sees a cell, the dtype's minimum
    where not."""
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)


def _fp32_rotary(model: Any) -> Any:
    """The rotary embedding's frequencies in fp32: ``model.to(bfloat16)`` casts its ``inv_freq`` buffer too,
    and angles of bf16 frequencies drift by radians past a few hundred positions. A fresh module from the
    config (fp32, as transformers makes it) replaces a cast one; an fp32 one stays as it is."""
    decoder = model.get_decoder()
    rotary = getattr(decoder, "rotary_emb", None)
    frequencies = getattr(rotary, "inv_freq", None)
    if rotary is None or frequencies is None or frequencies.dtype == torch.float32:
        return model
    # .to(device) keeps its fp32
    decoder.rotary_emb = type(rotary)(config=model.config).to(frequencies.device)
    return model


def _forward_kind(forward: str, model: Any, device: torch.device, layers: tuple[int, int] | None) -> str:
    """``hf`` or ``static``: ``auto`` is static on CUDA for a whole Llama-family model; ``static`` asked for
    where the model cannot take it is a ModelLoadError naming why."""
    from core.runners.static_forward import static_problem

    if forward not in FORWARDS:
        raise ModelLoadError(f"unknown forward {forward!r}: use one of {', '.join(FORWARDS)}")
    problem = "a pipeline stage (a slice of the layers)" if layers is not None else static_problem(model)
    if forward == "static" and problem is not None:
        raise ModelLoadError(f"forward static asked for, but {problem}")
    if forward == "auto":
        return "static" if device.type == "cuda" and problem is None else "hf"
    return forward


@functools.cache
def _cache_kwarg_of(function: Any) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(function).parameters else "past_key_values"


def _cache_kwarg(method: Any) -> str:
    """``cache`` since transformers 5.x (where ``past_key_values`` warns on every call), else
    ``past_key_values``."""
    return _cache_kwarg_of(getattr(method, "__func__", method))


class _SlotView:
    """The layers' ``past_key_values`` in one forward: ``update`` writes the new rows and returns the slots'
    cells ``[0, span)``."""

    is_compileable = False

    def __init__(
        self, runner: TransformersRunner, slots: torch.Tensor, cells: torch.Tensor, span: int
    ) -> None:
        self.runner, self.slots, self.cells, self.span = runner, slots, cells, span
        self._rows = slots[:, None].expand_as(cells)

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        layer = layer_idx - self.runner._first_layer  # a stage holds its own layers only
        for store, new in ((self.runner._keys[layer], keys), (self.runner._values[layer], values)):
            # new: [batch, heads, width, dim] -> cells (slot, cell) of the store [slots, heads, length, dim]
            store[self._rows, :, self.cells] = new.transpose(1, 2).to(store.dtype)
            out.append(store.index_select(0, self.slots)[:, :, : self.span])
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def _drop_other_layers(model: Any, first: int, end: int) -> None:
    """A stage's model keeps its layers (the rest become identities: indices stay absolute), the embeddings
    and norm it uses."""
    decoder = model.get_decoder()
    num_layers = len(decoder.layers)
    for i in range(num_layers):
        if not first <= i < end:
            decoder.layers[i] = torch.nn.Identity()
    tied = model.get_output_embeddings().weight is decoder.embed_tokens.weight
    if first > 0 and not (end == num_layers and tied):
        decoder.embed_tokens = torch.nn.Identity()
    if end < num_layers:
        decoder.norm = torch.nn.Identity()
        model.lm_head = torch.nn.Identity()


def _load_model(source: ModelSource, vocab_size: int) -> Any:
    from transformers import AutoModelForCausalLM

    if source.is_tiny_random:
        return tiny_random_model(vocab_size, seed=source.seed)
    if source.is_random:
        return builtin_architecture_model(seed=source.seed)
    try:
        if source.is_gguf:
            assert source.path is not None
            return _load_gguf(source.path)
        return AutoModelForCausalLM.from_pretrained(str(source.path or source.hub_id), dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"transformers cannot load {source.path or source.hub_id}: {exc}") from exc


def _load_gguf(path: Path) -> Any:
    """Dequantize a GGUF to fp32 once, then reload the cached safetensors (seconds, not a minute)."""
    from transformers import AutoModelForCausalLM

    cached = cache_dir() / "dequantized" / file_key(path)
    if (cached / "config.json").is_file():
        # made whole (renamed into place): no lock, so a read-only cache serves (an image's)
        return AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32)
    with cache_lock(cached):  # a pipeline's stages start together: one dequantizes, the others load its file
        if (cached / "config.json").is_file():
            return AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32)
        log.info("dequantizing %s for transformers (first use, cached in %s)", path.name, cached)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        # the weights are plain fp32 now: drop the GGUF quantizer marks that block save_pretrained
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        save_to_cache(model, cached)
        return model


def builtin_architecture_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """SmolLM2-135M's architecture with random weights: a forward's cost does not depend on them (timing
    without the GGUF)."""
    return _seeded_llama(
        seed,
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ).to(dtype)


def tiny_random_model(vocab_size: int, seed: int = 0) -> Any:
    """A 2-layer random-weight Llama over the shared vocabulary (tests only)."""
    # initializer_range 0.5: peaked distributions, so top-k and argmax tests mean something
    return _seeded_llama(
        seed,
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.5,
        tie_word_embeddings=True,
    ).float()


def _seeded_llama(seed: int, **config: Any) -> Any:
    """A ``LlamaForCausalLM`` of ``config`` with weights from ``seed``, leaving the global generator as it
    was."""
    from transformers import LlamaConfig, LlamaForCausalLM

    llama_config = LlamaConfig(**config)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return LlamaForCausalLM(llama_config)
    finally:
        torch.random.set_rng_state(generator_state)
