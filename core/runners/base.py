"""The ModelRunner interface (DESIGN §7): one per backend, used for the draft and the target.

A runner holds sessions: a token sequence with its KV cache. The caller (gateway or worker)
owns the sequence; the runner's copy is a cache it may drop and rebuild.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from core.errors import ContextOverflow


@dataclass(frozen=True)
class RunnerInfo:
    """What a loaded model is: reported by a worker's ``/v1/info``."""

    model_id: str
    backend: str
    vocab_size: int
    max_context: int
    eos_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.vocab_size <= 0 or self.max_context <= 0:
            raise ValueError(f"vocab_size and max_context must be > 0: {self}")


class ModelRunner(ABC):
    """Prefill a session, append tokens, score the last positions, crop, free."""

    info: RunnerInfo
    tokenizer: Any  # the HF tokenizer; the same object for every runner of one model

    def __init__(self) -> None:
        self._tokens: dict[str, list[int]] = {}

    @cached_property
    def fingerprint(self) -> str:
        """The tokenizer fingerprint (DESIGN §4) that gateway and workers must share."""
        from core.runners.tokenizer import tokenizer_fingerprint

        return tokenizer_fingerprint(self.tokenizer)

    # ----------------------------------------------------------------- session state

    def has_session(self, session_id: str) -> bool:
        return session_id in self._tokens

    def tokens(self, session_id: str) -> list[int]:
        """The tokens the session holds (a copy); empty for an unknown session."""
        return list(self._tokens.get(session_id, ()))

    def length(self, session_id: str) -> int:
        return len(self._tokens.get(session_id, ()))

    def session_ids(self) -> list[str]:
        return list(self._tokens)

    def prefill(self, session_id: str, tokens: list[int], num_logits: int = 1) -> torch.Tensor:
        """Start ``session_id`` afresh with ``tokens``; logits of the last ``num_logits``."""
        self.free(session_id)
        return self.append(session_id, tokens, num_logits)

    def append(self, session_id: str, tokens: list[int], num_logits: int) -> torch.Tensor:
        """Append ``tokens``; return fp32 logits ``[num_logits, V]`` of the last positions.

        ``num_logits`` may exceed ``len(tokens)``: earlier held positions are re-scored.
        """
        held = self._tokens.setdefault(session_id, [])
        total = len(held) + len(tokens)
        if not 0 < num_logits <= total:
            raise ValueError(f"num_logits {num_logits} outside [1, {total}]")
        if total > self.info.max_context:
            raise ContextOverflow(
                f"session would hold {total} tokens, the context is {self.info.max_context}",
                param="draft",
            )
        held.extend(int(t) for t in tokens)
        return self._forward(session_id, held, num_logits)

    def crop(self, session_id: str, length: int) -> None:
        """Keep the first ``length`` tokens of the session (and their KV entries)."""
        held = self._tokens.get(session_id)
        if held is None or length >= len(held):
            return
        del held[length:]
        self._crop_cache(session_id, length)

    def free(self, session_id: str) -> None:
        """Forget the session and release its KV cache at once."""
        if self._tokens.pop(session_id, None) is not None:
            self._free_cache(session_id)

    def memory_bytes(self) -> int:
        """Bytes held by session caches (what a memory cap counts)."""
        return sum(len(t) for t in self._tokens.values()) * self.kv_bytes_per_token()

    def free_all(self) -> None:
        for session_id in self.session_ids():
            self.free(session_id)

    def close(self) -> None:
        """Free every session and what the backend holds; the runner is unusable after."""
        self.free_all()

    # ----------------------------------------------------------------- per backend

    @abstractmethod
    def _forward(self, session_id: str, tokens: list[int], num_logits: int) -> torch.Tensor:
        """Bring the session's cache up to ``tokens``; logits of the last ``num_logits``."""

    @abstractmethod
    def _crop_cache(self, session_id: str, length: int) -> None: ...

    @abstractmethod
    def _free_cache(self, session_id: str) -> None: ...

    @abstractmethod
    def kv_bytes_per_token(self) -> int: ...

    @abstractmethod
    def forward_full(self, tokens: list[int], num_logits: int) -> torch.Tensor:
        """A fresh, sessionless forward pass over ``tokens``: the reference for tests/bench."""


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
