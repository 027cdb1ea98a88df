"""Gateways in the test process (``gateway_in_process``): a real uvicorn on 127.0.0.1, drafting with the
shared built-in draft."""

from __future__ import annotations

from contextlib import ExitStack

from fastapi import FastAPI

from app.server import create_app, load_draft
from core.config import SpecgateConfig
from core.runners import ModelRunner
from core.runners.model_thread import ModelThread
from tests.app.helpers import served


class SharedDraft:
    """The built-in draft on one thread (``draft.threads: 1``), a runner per setting ``load_draft`` reads (the
    context: its KV streams' length; the memory cap, device, dtype, forward)."""

    def __init__(self) -> None:
        self.thread = ModelThread()
        self.runners: dict[tuple[object, ...], ModelRunner] = {}

    def runner(self, config: SpecgateConfig) -> ModelRunner:
        draft = config.draft
        assert (draft.model, draft.backend.value, draft.threads) == ("builtin-draft", "llama.cpp", 1), (
            f"not the shared draft: {draft}"
        )
        key = (config.draft_context, draft.memory_cap_mb, draft.device, draft.dtype, draft.forward)
        if key not in self.runners:
            self.runners[key] = self.thread.call(load_draft, config)
        return self.runners[key]

    def close(self) -> None:
        for runner in self.runners.values():
            self.thread.call(runner.close)
        self.thread.close()


def gateway_app(config: SpecgateConfig, draft: SharedDraft) -> FastAPI:
    """The gateway app for ``config``, drafting with ``draft``."""
    return create_app(config, draft_runner=draft.runner(config), model_thread=draft.thread)


def gateway_in_process(stack: ExitStack, config: SpecgateConfig, draft: SharedDraft) -> str:
    """The URL of a gateway for ``config`` under a real uvicorn on 127.0.0.1 in this process, drafting with
    ``draft``."""
    return stack.enter_context(served(gateway_app(config, draft)))
