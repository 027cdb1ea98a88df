"""The step policy both step batchers take (the draft's ``app.drafting.batcher``, the worker's
``workers.scheduler``): what waits goes in arrival order, within a step's row budget."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

T = TypeVar("T")


def take_within(
    waiting: Iterable[T], rows: Callable[[T], int], budget: int, key: Callable[[T], Hashable]
) -> list[T]:
    """What waits, oldest first, one entry per ``key``, within ``budget`` rows (the first always goes), up to
    the first misfit: none waits long."""
    taken: list[T] = []
    keys: set[Hashable] = set()
    used = 0
    for entry in waiting:
        if key(entry) in keys:
            continue
        if taken and used + rows(entry) > budget:
            break
        taken.append(entry)
        keys.add(key(entry))
        used += rows(entry)
    return taken
