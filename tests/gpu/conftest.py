"""Each GPU test leaves the GPU as it found it: what its runners held goes back to the device (a KV budget is
a share of the GPU's memory less what is in use, and memory PyTorch keeps cached would read as used to the
next test's runners)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _the_gpu_freed() -> Iterator[None]:
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
