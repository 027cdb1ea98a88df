"""A runner wrapper for the worker's tests: its forward waits at a gate, so a test can act
while a step is in the model (the loop stays free; calls queue up behind it)."""

from __future__ import annotations

import threading
from typing import Any

import torch

from core.runners import ModelRunner


class GatedRunner:
    def __init__(self, inner: ModelRunner) -> None:
        self._inner = inner
        self.entered = threading.Event()  # set once a step reached the model
        self.gate = threading.Event()  # set to let it (and every later step) through

    def forward_each(self, *args: Any, **kwargs: Any) -> list[torch.Tensor | Exception]:
        self.entered.set()
        self.gate.wait(timeout=10)
        return self._inner.forward_each(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
