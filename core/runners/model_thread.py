"""The one thread that calls a process's runner: load, forward, free, close. llama.cpp's OpenMP team
belongs to the calling thread, and a second one slows every decode (measured: 7.5 ms on one thread,
12–17 ms loaded on the main thread and decoded on another); the event loop stays free meanwhile."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class ModelThread:
    """Usage: ``thread = ModelThread(); runner = thread.call(load_runner, "builtin")``, then
    ``await thread.run(runner.append, session, tokens, 1)`` from the event loop."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the model thread, awaited without blocking the loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the model thread, from a thread that may block (start-up, shutdown)."""
        return self._executor.submit(fn, *args).result()

    def close(self) -> None:
        self._executor.shutdown(wait=True)


class CallingThread(ModelThread):
    """A ``ModelThread`` that runs each call where it is made (single-threaded tools and tests)."""

    def __init__(self) -> None:
        pass

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)

    def close(self) -> None:
        pass
