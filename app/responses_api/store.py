"""Stored responses (``store``, ``previous_response_id``, ``GET`` / ``DELETE /v1/responses/{id}``): an embedded SQLite
database, one per gateway (docs/scaling.md: what many gateways need). Each row holds the response object and the
conversation it ends, as input items; rows older than the retention go at the next write."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from core.errors import ConfigError

MEMORY = "memory"
NONE = "none"
AUTO = "auto"


def default_path() -> Path:
    """``$XDG_STATE_HOME/specgate/responses.sqlite3`` (``~/.local/state`` when unset)."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "specgate" / "responses.sqlite3"


class ResponseStore:
    """A SQLite table of responses. Calls are short and serialised by a lock (the gateway calls them off its event loop)."""

    def __init__(self, where: str, retention_s: float) -> None:
        self.retention_s = retention_s
        self.where = ":memory:" if where == MEMORY else str(default_path() if where == AUTO else Path(where).expanduser())
        self._lock = threading.Lock()
        try:
            if self.where != ":memory:":
                Path(self.where).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.where, check_same_thread=False, timeout=10, isolation_level=None)
            if self.where != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")  # readers beside the writer; several gateways may share a file on one disk
            self._db.execute("CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, created_at REAL NOT NULL, response TEXT NOT NULL, conversation TEXT NOT NULL)")
            self._db.execute("CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at)")
        except (OSError, sqlite3.Error) as exc:
            raise ConfigError(f"responses.store: cannot open {self.where}: {exc} (give a writable path, memory, or none)") from None

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        now = time.time()
        with self._lock:
            self._db.execute("DELETE FROM responses WHERE created_at < ?", (now - self.retention_s,))
            self._db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)",
                (response["id"], now, json.dumps(response), json.dumps(conversation)),
            )

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """(the response, the conversation it ends), or None (never stored, deleted, or past the retention)."""
        with self._lock:
            row = self._db.execute(
                "SELECT response, conversation FROM responses WHERE id = ? AND created_at >= ?", (response_id, time.time() - self.retention_s),
            ).fetchone()
        return None if row is None else (json.loads(row[0]), json.loads(row[1]))

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()
