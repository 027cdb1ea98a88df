"""Stored responses (``store``, ``previous_response_id``, ``GET`` / ``DELETE /v1/responses/{id}``, ``GET
/v1/responses/{id}/input_items``): an embedded SQLite database, one per gateway (docs/scaling.md: what many gateways
need).

Each row holds its response object, the input items its own request added and its output, and names the response it
continued: a conversation is its chain read back, so a 50-turn chain holds each item once. The tools, which an agent
sends whole with every turn, are kept once by their digest. A chaining touches every response of its chain, and what
goes first (past ``retention_s``, or over ``max_bytes``) is what was used least recently: a chain in use stays whole.
The file is the user's alone (0600, in a folder of 0700 that the store makes)."""

from __future__ import annotations

import hashlib
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

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS blobs (digest TEXT PRIMARY KEY, body TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS stored (id TEXT PRIMARY KEY, previous TEXT, created_at REAL NOT NULL, used_at REAL NOT NULL,"
    " deleted INTEGER NOT NULL DEFAULT 0, response TEXT NOT NULL, tools TEXT, input TEXT NOT NULL, output TEXT NOT NULL, size INTEGER NOT NULL)",
    "CREATE INDEX IF NOT EXISTS stored_used_at ON stored (used_at)",
    "CREATE INDEX IF NOT EXISTS stored_previous ON stored (previous)",
    "DROP TABLE IF EXISTS responses",  # the first version's table: a row per response holding its whole conversation
)
_CHAIN = """WITH RECURSIVE chain(id, previous, depth) AS (
    SELECT id, previous, 0 FROM stored WHERE id = ?
    UNION ALL SELECT s.id, s.previous, c.depth + 1 FROM stored s JOIN chain c ON s.id = c.previous
) """


def default_path() -> Path:
    """``$XDG_STATE_HOME/specgate/responses.sqlite3`` (``~/.local/state`` when unset)."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "specgate" / "responses.sqlite3"


class ResponseStore:
    """A SQLite store of responses. Calls are short and serialised by a lock (the gateway calls them off its event loop)."""

    def __init__(self, where: str, retention_s: float, max_bytes: int = 128 * 2**20) -> None:
        self.retention_s, self.max_bytes = retention_s, max_bytes
        self.where = ":memory:" if where == MEMORY else str(default_path() if where == AUTO else Path(where).expanduser())
        self._lock = threading.Lock()
        try:
            if self.where != ":memory:":
                _private_file(Path(self.where))
            self._db = sqlite3.connect(self.where, check_same_thread=False, timeout=10, isolation_level=None)
            self._db.execute("PRAGMA auto_vacuum=INCREMENTAL")  # takes effect on a new file: freed pages go back at the vacuum after a cleanup
            if self.where != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")  # readers beside the writer; several gateways may share a file on one disk
            for statement in _SCHEMA:
                self._db.execute(statement)
        except (OSError, sqlite3.Error) as exc:
            raise ConfigError(f"responses.store: cannot open {self.where}: {exc} (give a writable path, memory, or none)") from None

    def put(self, response: dict[str, Any], new_items: list[dict[str, Any]], output: list[dict[str, Any]], previous: str | None = None) -> None:
        """Keep ``response``: the input items its request added (after ``previous``'s conversation) and its ``output``
        (as input items). One transaction, committed when this returns; ``previous``'s chain is touched."""
        now = time.time()
        tools = json.dumps(response.get("tools", []), separators=(",", ":"))
        digest = hashlib.sha256(tools.encode()).hexdigest()
        body = json.dumps({k: v for k, v in response.items() if k != "tools"}, separators=(",", ":"))
        given, made = json.dumps(new_items, separators=(",", ":")), json.dumps(output, separators=(",", ":"))
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("INSERT OR IGNORE INTO blobs VALUES (?, ?)", (digest, tools))
            self._db.execute(
                "INSERT OR REPLACE INTO stored (id, previous, created_at, used_at, response, tools, input, output, size) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (response["id"], previous, now, now, body, digest, given, made, len(body) + len(given) + len(made)),
            )
            if previous is not None:
                self._db.execute(_CHAIN + "UPDATE stored SET used_at = ? WHERE id IN (SELECT id FROM chain)", (previous, now))
            self._clean(now)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """(the response, the conversation it ends), or None (never stored, deleted, past the retention, or a response
        of its chain gone)."""
        with self._lock:
            row = self._row(response_id)
            chain = self._chain(response_id) if row is not None else None
        if row is None or chain is None:
            return None
        return row, [item for _, given, made in chain for item in given + made]

    def input_items(self, response_id: str) -> list[dict[str, Any]] | None:
        """What the response answered: its chain's conversation, then its own input; None as ``get``."""
        with self._lock:
            chain = self._chain(response_id) if self._row(response_id) is not None else None
        if chain is None:
            return None
        return [item for _, given, made in chain[:-1] for item in given + made] + chain[-1][1]

    def delete(self, response_id: str) -> bool:
        """Gone for ``GET`` and for chaining; its items stay while a later response's chain runs through it."""
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            if self._db.execute("UPDATE stored SET deleted = 1 WHERE id = ? AND deleted = 0", (response_id,)).rowcount == 0:
                return False
            self._db.execute("DELETE FROM stored WHERE id = ? AND NOT EXISTS (SELECT 1 FROM stored c WHERE c.previous = ?)", (response_id, response_id))
            return True

    def size(self) -> int:
        """Bytes the stored responses and their tools take (what ``max_bytes`` holds)."""
        with self._lock:
            return self._size()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _row(self, response_id: str) -> dict[str, Any] | None:
        found = self._db.execute(
            "SELECT s.response, b.body FROM stored s LEFT JOIN blobs b ON b.digest = s.tools WHERE s.id = ? AND s.deleted = 0 AND s.used_at >= ?",
            (response_id, time.time() - self.retention_s),
        ).fetchone()
        return None if found is None else {**json.loads(found[0]), "tools": json.loads(found[1] or "[]")}

    def _chain(self, response_id: str) -> list[tuple[str, list[dict[str, Any]], list[dict[str, Any]]]] | None:
        """(id, its input, its output) from the chain's first response to ``response_id``; None if a link is gone."""
        rows = self._db.execute(_CHAIN + "SELECT s.id, s.previous, s.input, s.output FROM chain c JOIN stored s ON s.id = c.id ORDER BY c.depth DESC", (response_id,)).fetchall()
        if not rows or rows[0][1] is not None:
            return None
        return [(row[0], json.loads(row[2]), json.loads(row[3])) for row in rows]

    def _size(self) -> int:
        rows = self._db.execute("SELECT COALESCE(SUM(size), 0) FROM stored").fetchone()[0]
        blobs = self._db.execute("SELECT COALESCE(SUM(LENGTH(body)), 0) FROM blobs").fetchone()[0]
        return int(rows) + int(blobs)

    def _clean(self, now: float) -> None:
        """Past the retention, then the least recently used while over ``max_bytes``; the tools no row names; the freed pages."""
        removed = self._db.execute("DELETE FROM stored WHERE used_at < ?", (now - self.retention_s,)).rowcount
        over = self._size() - self.max_bytes
        if over > 0:
            dropped = 0
            ordered = "SELECT id, size FROM stored ORDER BY used_at, created_at DESC"  # a tie: a chain's later responses before the ones they continue
            for response_id, size in self._db.execute(ordered).fetchall():
                if dropped >= over:
                    break
                self._db.execute("DELETE FROM stored WHERE id = ?", (response_id,))
                dropped, removed = dropped + size, removed + 1
        if removed:
            self._db.execute("DELETE FROM blobs WHERE digest NOT IN (SELECT tools FROM stored WHERE tools IS NOT NULL)")
            self._db.execute("PRAGMA incremental_vacuum")


def _private_file(path: Path) -> None:
    """``path``'s folder made 0700 (when the store makes it) and the file created 0600: SQLite's journal files take the
    file's mode."""
    if not path.parent.exists():
        path.parent.mkdir(parents=True, mode=0o700)
    os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
    os.chmod(path, 0o600)
