"""A step's one upload (issue 73): every number the host brings to a step — the forward's inputs, the rows
kept for the head, cache moves, the transforms' ids and masks, the scorer's drafts, supports and uniforms'
keys — gathered into one persistent int64 buffer and sent to the device in **one** non-blocking copy. On a GPU
the host buffers are pinned (a copy from pageable memory waits for the stream) and there are two of them: the
host fills one while the copy from the other may still be in flight (an event says when it may be written
again). Parts add their arrays before ``send`` and read device views after it; on the CPU the device buffer is
an ordinary tensor and the copy a memcpy, through the same code.

A step is ``begin`` … ``end``; whoever begins it (the worker's step, or the runner where nothing else did)
ends it. What is added after a send (a step whose sessions outnumber the KV slots forwards in turns) goes in a
second copy of only the new words: what was sent stays where it landed. Values travel as int64 words: integers
as themselves, float64 as their bits, bytes (a grammar's packed masks) eight to a word; ``view`` gives them
back in their dtype where they landed, with nothing read back to the host; ``download`` is the one copy
back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_KINDS = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.uint8): torch.uint8,
}


@dataclass(frozen=True)
class Segment:
    """Where an array landed in the step's upload: its first word, its words, its dtype and shape."""

    start: int
    words: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class StepUpload:
    """``begin()``; ``add(array)`` per part → a Segment; ``send()``; ``view(segment)`` → the device tensor;
    ``end()``."""

    def __init__(self, device: torch.device, words: int = 1 << 15) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._hosts = [self._host(words), self._host(words)]
        self._events: list[Any] = [None, None]  # torch.cuda.Event of each host buffer's last copy
        self._turn = 0
        self._used = 0  # words added this step
        self._sent = 0  # of them, on the device
        self._device = self._device_buffer(words)
        self._after: list[Callable[[], None]] = []
        self.in_step = False
        self.sends = 0  # copies made (tests: one a step)

    def _host(self, words: int) -> torch.Tensor:
        with torch.inference_mode(False):
            # made inside a forward, it would be an inference tensor no later step could write
            return torch.empty(words, dtype=torch.int64, pin_memory=self._pinned)

    def _device_buffer(self, words: int) -> torch.Tensor:
        with torch.inference_mode(False):
            return torch.empty(words, dtype=torch.int64, device=self.device)

    @property
    def host(self) -> torch.Tensor:
        return self._hosts[self._turn]

    @property
    def open(self) -> bool:
        """Something added this step is not on the device yet."""
        return self.in_step and (self._used > self._sent or bool(self._after))

    def begin(self) -> None:
        """A new step: the other host buffer, once its last copy is done (long done, a step ago)."""
        self._turn ^= 1
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()
            self._events[self._turn] = None
        self._used = self._sent = 0
        self._after = []
        self.in_step = True

    def end(self) -> None:
        self.in_step = False

    def add(self, array: np.ndarray) -> Segment:
        """Queue ``array`` (int64, float64 or uint8; any shape) for the step's copy."""
        array = np.ascontiguousarray(array)
        dtype = _KINDS.get(array.dtype)
        if dtype is None:
            raise TypeError(f"a step's upload takes int64, float64 or uint8 arrays, not {array.dtype}")
        raw = array.reshape(-1).view(np.uint8)
        words = -(-raw.size // 8)
        start = self._reserve(words)
        host = self.host.numpy()
        if raw.size == words * 8:
            host[start : start + words] = raw.view(np.int64)
        elif words:  # bytes: the last word padded with zeros
            host[start + words - 1] = 0
            host[start : start + words].view(np.uint8)[: raw.size] = raw
        return Segment(start, words, dtype, tuple(array.shape))

    def add_ints(self, values: list[int] | np.ndarray) -> Segment:
        return self.add(np.asarray(values, dtype=np.int64))

    def reserve(self, words: int) -> tuple[Segment, np.ndarray]:
        """``words`` int64 words to fill in place (the forward's inputs): their Segment and a writable host
        view."""
        start = self._reserve(words)
        return Segment(start, words, torch.int64, (words,)), self.host.numpy()[start : start + words]

    def after_send(self, work: Callable[[], None]) -> None:
        """``work()`` right after the step's copy, before anything else runs on what it sent (a cache move of
        the runner's)."""
        self._after.append(work)

    def _reserve(self, words: int) -> int:
        if not self.in_step:
            raise RuntimeError("a step's upload is added to between begin() and end()")
        start, end = self._used, self._used + words
        if end > self.host.numel():
            self._grow(end)
        self._used = end
        return start

    def _grow(self, words: int) -> None:
        size = max(words, 2 * self.host.numel())
        for turn in (0, 1):
            if turn != self._turn and self._events[turn] is not None:
                self._events[turn].synchronize()
                self._events[turn] = None
        bigger = self._host(size)
        bigger[: self._used].copy_(self.host[: self._used])
        self._hosts = [bigger if turn == self._turn else self._host(size) for turn in (0, 1)]

    def send(self) -> None:
        """The step's copy of what was added since the last (non-blocking from pinned memory on a GPU), then
        the after-send work."""
        if self._device.numel() < self._used:
            # what was sent stays valid: a view keeps its own storage, the new buffer a copy
            bigger = self._device_buffer(max(self._used, 2 * self._device.numel()))
            bigger[: self._sent].copy_(self._device[: self._sent])
            self._device = bigger
        if self._used > self._sent:
            self._device[self._sent : self._used].copy_(
                self.host[self._sent : self._used], non_blocking=self._pinned
            )
            if self._pinned:
                event = torch.cuda.Event()
                event.record()
                self._events[self._turn] = event
            self.sends += 1
        self._sent = self._used
        after, self._after = self._after, []
        for work in after:
            work()

    def view(self, segment: Segment) -> torch.Tensor:
        """The segment on the device, in its dtype and shape (valid until the next step's ``send``)."""
        if segment.start + segment.words > self._sent:
            raise RuntimeError("a segment is read on the device before the step's upload is sent")
        words = self._device[segment.start : segment.start + segment.words]
        if segment.dtype == torch.int64:
            return words.view(segment.shape)
        if segment.dtype == torch.float64:
            return words.view(torch.float64).view(segment.shape)
        count = int(np.prod(segment.shape))
        return words.view(torch.uint8)[:count].view(segment.shape)

    def download(self, tensor: torch.Tensor) -> np.ndarray:
        """The step's one copy back to the host: the only read of the device's memory a step makes
        (tests/workers/test_step_syncs.py)."""
        return tensor.cpu().numpy()
