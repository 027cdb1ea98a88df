"""How a target call fails (docs/design.md §1, §4): a replica's failure, and what the engine sees.

ReplicaFailure   one replica failed one call (``kind``: one of FAILURE_KINDS); the session moves on
WorkerError      what the engine sees: no replica of a target is left, or the target refused the request
itself"""

from __future__ import annotations

import httpx

from core.errors import ProtocolError, SpecgateError
from core.protocol import ErrorBody

FAILURE_KINDS = (
    "connect",
    "timeout",
    "transport",
    "http_5xx",
    "garbage",
    "fingerprint",
    "unauthorized",
    "rejected",
)


class WorkerError(SpecgateError):
    """A target that is down, timed out, or answered something unusable."""

    def __init__(self, worker: str, message: str, status: int = 502) -> None:
        super().__init__(f"worker {worker}: {message}")
        self.worker, self.status = worker, status


class ReplicaFailure(SpecgateError):
    """One replica failed one call; ``kind`` is one of FAILURE_KINDS."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class AskAgain(SpecgateError):
    """A replica that answered for now only (``app.targets.replicas`` retries, the one layer that does):
    ``held`` — it holds fewer rows of the session than the call assumed (a 409: send again from there); else
    it is full (a 503 ``worker_full``: wait)."""

    def __init__(self, message: str, held: int | None = None) -> None:
        super().__init__(message)
        self.held = held


def status_failure(status: int, body: bytes, what: str) -> ReplicaFailure:
    """A non-200 answer: 5xx and 401/403 are the replica's fault; other 4xx are the request's."""
    message = f"{what}: HTTP {status}: {error_message(body)}"
    if status >= 500:
        return ReplicaFailure("http_5xx", message)
    if status in (401, 403):
        return ReplicaFailure("unauthorized", f"{message} (is SPECGATE_WORKER_TOKEN the same on both sides?)")
    return ReplicaFailure("rejected", message)


def refused(name: str, failure: ReplicaFailure) -> SpecgateError:
    """A ``rejected`` failure is the request's own (every replica would refuse it): a WorkerError."""
    return WorkerError(name, str(failure)) if failure.kind == "rejected" else failure


def error_body(body: bytes) -> ErrorBody | None:
    try:
        return ErrorBody.from_json(body)
    except ProtocolError:
        return None


def error_message(body: bytes) -> str:
    """The message of an error body in the OpenAI envelope, else the body's first bytes."""
    error = error_body(body)
    return error.message if error is not None else repr(body[:200])


def describe(exc: httpx.HTTPError) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
