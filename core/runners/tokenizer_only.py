"""``draft.model: none`` (docs/design.md §3.10): a runner without weights, for the tokenizer and facts
(vocabulary, EOS ids, context); lookup never calls it."""

from __future__ import annotations

from typing import Any

import torch

from core.runners.base import ModelRunner, Rows, RunnerInfo
from core.runners.models import resolve_model
from core.runners.tokenizer import eos_ids, load_tokenizer

NONE = "none"  # the draft model's name that means none


def tokenizer_only(name: str, max_context: int) -> TokenizerOnly:
    """The runner of a gateway without a draft model: ``name``'s tokenizer (a ``--model`` value)."""
    return TokenizerOnly(name, load_tokenizer(resolve_model(name)), max_context)


class TokenizerOnly(ModelRunner):
    has_weights = False

    def __init__(self, name: str, tokenizer: Any, max_context: int) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.info = RunnerInfo(
            model_id=f"none ({name}'s tokenizer)",
            backend=NONE,
            vocab_size=len(tokenizer),
            max_context=max_context,
            eos_ids=eos_ids(tokenizer),
        )

    def _compute(self, session_id: str, rows: Rows, start: int, logits_rows: list[int]) -> torch.Tensor:
        raise RuntimeError("this gateway has no draft model (draft.model: none): only lookup drafts")

    def forward_full(self, tokens: list[int], num_logits: int) -> torch.Tensor:
        raise RuntimeError("this gateway has no draft model (draft.model: none)")
