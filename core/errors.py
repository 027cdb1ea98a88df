"""The one exception tree of specgate. Outside errors (httpx, torch, llama.cpp, OS) are
mapped onto it once, at the edge where they happen (``raise Specific(...) from exc``).

    SpecgateError
    ├── ConfigError              a bad setting: names the key or the value
    ├── ModelLoadError           a missing model, a bad path, an unreadable file, a vocab mismatch
    ├── ProtocolError            a body that does not decode or breaks a protocol rule
    │   └── InvalidRequest       well-formed, but a value is out of range (ids ≥ V, k ≤ 0, …)
    │       └── ContextOverflow  the request does not fit the context that is left
    ├── SessionShort             a worker holds fewer tokens than asked, or other ones
    ├── WorkerDraining           a worker shutting down takes no new session: another replica takes it
    └── WorkerFull               every KV slot of a worker is held by a session in use: retry later
"""

from __future__ import annotations


class SpecgateError(Exception):
    """Base of every error specgate raises on purpose."""


class ConfigError(SpecgateError):
    pass


class ModelLoadError(SpecgateError):
    pass


class ProtocolError(SpecgateError):
    """A body that cannot be decoded, or a field of the wrong type or shape."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidRequest(ProtocolError):
    """A decodable request with a value out of range."""


class SessionShort(SpecgateError):
    """The worker holds ``held`` agreed tokens of the session, fewer than the request assumes."""

    def __init__(self, session_id: str, held: int, reason: str) -> None:
        super().__init__(f"session {session_id!r}: {reason}; the worker holds {held} tokens")
        self.session_id = session_id
        self.held = held
        self.reason = reason


class ContextOverflow(InvalidRequest):
    pass


class WorkerDraining(SpecgateError):
    """The worker got SIGTERM: its sessions go on, a new one is refused (503, Retry-After) and goes to another
    replica."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(
            "worker draining: it is shutting down and takes no new session; retry on another "
            f"replica after {retry_after_s} s"
        )
        self.retry_after_s = retry_after_s


class WorkerFull(SpecgateError):
    """Every KV slot is held by a session used in the last ``live_s`` s: taking one would rebuild a live cache
    (each step, under overload). 503, Retry-After."""

    def __init__(self, live: int, live_s: float, retry_after_s: int) -> None:
        super().__init__(
            f"worker full: every KV slot is held by one of the {live} sessions used in the last "
            f"{live_s:g} s; retry after {retry_after_s} s"
        )
        self.retry_after_s = retry_after_s
