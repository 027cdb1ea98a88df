"""Plug-ins: modules a process imports at start-up, before it reads its configuration, so that what they
register is served — a mode (core.modes.register, with its strategy in app.engine.strategies.STRATEGIES), a
kind of answer, a drafter, a tool format. ``SPECGATE_PLUGINS`` names them, comma-separated; the gateway and
every worker import them (``specgate serve``'s processes inherit the variable), each before its first
request."""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping

from core.errors import ConfigError

VARIABLE = "SPECGATE_PLUGINS"


def load_plugins(env: Mapping[str, str] = os.environ) -> list[str]:
    """Import each module ``SPECGATE_PLUGINS`` names; one that does not import is a ConfigError naming it."""
    names = [name.strip() for name in env.get(VARIABLE, "").split(",") if name.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:
            raise ConfigError(f"{VARIABLE}: {name!r} does not import: {type(exc).__name__}: {exc}") from None
    return names
