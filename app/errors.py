"""The gateway's errors (docs/design.md §5): each a ``SpecgateError`` the routes turn into the envelope
``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from core.errors import SpecgateError


class ApiError(SpecgateError):
    """An error for the client, in the OpenAI envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
