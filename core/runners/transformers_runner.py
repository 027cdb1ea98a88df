"""The ``transformers`` backend (DESIGN §7): any HF checkpoint or GGUF transformers can load,
CPU or CUDA, and the tiny random-weight models of the tests. One DynamicCache per session;
tree rows through an additive float 4-D mask and ``position_ids``, a path kept by
``index_select`` on every cache layer (DESIGN §7)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from core.errors import ModelLoadError
from core.names import Backend
from core.runners.base import ModelRunner, Rows, RunnerInfo
from core.runners.models import ModelSource, cache_dir, file_key
from core.runners.tokenizer import eos_ids

log = logging.getLogger(__name__)


class TransformersRunner(ModelRunner):
    def __init__(
        self,
        source: ModelSource,
        tokenizer: Any,
        max_context: int = 2048,
        device: str = "cpu",
        model: Any = None,
    ) -> None:
        """``model``: an already built model to run instead of loading ``source`` (benchmarks
        with random weights of a real architecture)."""
        super().__init__()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.model = (model if model is not None else _load_model(source, len(tokenizer))).to(self.device).eval()
        config = self.model.config
        self.info = RunnerInfo(
            model_id=source.name,
            backend=Backend.TRANSFORMERS.value,
            vocab_size=int(config.vocab_size),
            max_context=min(max_context, int(config.max_position_embeddings)),
            eos_ids=eos_ids(tokenizer),
        )
        self._caches: dict[str, Any] = {}
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        elem = torch.finfo(self.model.dtype).bits // 8
        self._kv_bytes = 2 * config.num_hidden_layers * kv_heads * head_dim * elem

    def kv_bytes_per_token(self) -> int:
        return self._kv_bytes

    @torch.inference_mode()
    def _compute(self, session_id: str, rows: Rows, start: int, logits_rows: list[int]) -> torch.Tensor:
        from transformers import DynamicCache

        cache = self._caches.setdefault(session_id, DynamicCache())
        begin = min(cache.get_seq_length(), start)
        _crop(cache, begin)
        input_ids = torch.tensor([rows.tokens[begin:]], dtype=torch.long, device=self.device)
        first = min(logits_rows)
        if rows.chain == len(rows):  # a plain chain: the library's causal mask
            out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=len(rows) - first)
        else:
            mask, positions = self._tree_inputs(rows, begin)
            out = self.model(
                input_ids=input_ids, attention_mask=mask, position_ids=positions,
                past_key_values=cache, use_cache=True, logits_to_keep=len(rows) - first,
            )
        logits = out.logits[0]
        picked = torch.tensor([r - first for r in logits_rows], device=logits.device) + logits.shape[0] - (len(rows) - first)
        return logits.index_select(0, picked).float().cpu()

    def _tree_inputs(self, rows: Rows, begin: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The additive float 4-D mask (0 / finfo.min: a bool mask is wrong under eager attention)
        and the position ids (= depth) of rows ``[begin, len)`` over the cache's rows."""
        total = len(rows)
        visible = torch.zeros(total - begin, total, dtype=torch.bool)
        for i, row in enumerate(range(begin, total)):
            visible[i, rows.ancestors(row)] = True
        dtype = self.model.dtype
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)
        positions = torch.tensor([rows.depths[begin:]], dtype=torch.long, device=self.device)
        return mask[None, None].to(self.device), positions

    def _keep_cache(self, session_id: str, rows: Rows, kept: list[int]) -> None:
        cache = self._caches.get(session_id)
        if cache is None:
            return
        if kept == list(range(len(kept))):
            _crop(cache, len(kept))
            return
        index = torch.tensor(kept, dtype=torch.long, device=self.device)
        for layer in cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(-2, index)
                layer.values = layer.values.index_select(-2, index)

    def _free_cache(self, session_id: str) -> None:
        self._caches.pop(session_id, None)

    @torch.inference_mode()
    def forward_full(self, tokens: list[int], num_logits: int) -> torch.Tensor:
        input_ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        out = self.model(input_ids=input_ids, use_cache=False)
        return out.logits[0, -num_logits:].float().cpu()


def _crop(cache: Any, length: int) -> None:
    """Keep ``length`` positions; a negative count removes tokens in every transformers version."""
    surplus = cache.get_seq_length() - length
    if surplus > 0:
        cache.crop(-surplus)


def _load_model(source: ModelSource, vocab_size: int) -> Any:
    from transformers import AutoModelForCausalLM

    if source.is_tiny_random:
        return tiny_random_model(vocab_size, seed=source.seed)
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
        return AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32)
    log.info("dequantizing %s for transformers (first use, cached in %s)", path.name, cached)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # the weights are plain fp32 now: drop the GGUF quantizer marks that block save_pretrained
    setattr(model, "hf_quantizer", None)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    model.save_pretrained(tmp)
    try:
        os.rename(tmp, cached)
    except OSError:  # another process saved the same weights first
        shutil.rmtree(tmp, ignore_errors=True)
    return model


def builtin_architecture_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """SmolLM2-135M's architecture (the built-in target) with random weights: what a forward
    costs does not depend on the weights, so machines without the GGUF can time it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    )
    return _seeded(LlamaForCausalLM, config, seed).to(dtype)


def tiny_random_model(vocab_size: int, seed: int = 0) -> Any:
    """A 2-layer random-weight Llama over the shared vocabulary (tests only)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.5,  # peaked distributions, so top-k and argmax tests mean something
        tie_word_embeddings=True,
    )
    return _seeded(LlamaForCausalLM, config, seed).float()


def _seeded(model_class: Any, config: Any, seed: int) -> Any:
    """``model_class(config)`` with weights from ``seed``, leaving the global generator as it was."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return model_class(config)
    finally:
        torch.random.set_rng_state(generator_state)
