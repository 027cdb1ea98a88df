"""Stored responses (``store``, ``previous_response_id``, ``GET`` / ``DELETE /v1/responses/{id}``, ``GET
/v1/responses/{id}/input_items``): an embedded SQLite database, one per gateway (docs/scaling.md: what many
gateways need).

Each row holds its response object (whose output is what it added) and the input items its own request added,
and names the response it continued: a conversation is its chain read back, so a 50-turn chain holds each item
once. The tools and instructions, which an agent sends whole with every turn, are kept once by their digest. A
chaining touches every response of its chain, and what goes first (past ``retention_s``, or over
``max_bytes``) is what was used least recently: a chain in use stays whole. The file is the user's alone
(0600, in a folder of 0700 that the store makes)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.responses_api.output import as_input
from core.errors import ConfigError

log = logging.getLogger("specgate.responses")

MEMORY = "memory"
NONE = "none"
AUTO = "auto"

# PRAGMA user_version of the layout below: a file of another version is laid out again (its responses dropped)
VERSION = 3
_SCHEMA = (
    "CREATE TABLE blobs (digest TEXT PRIMARY KEY, body TEXT NOT NULL)",
    "CREATE TABLE stored (id TEXT PRIMARY KEY, previous TEXT, created_at REAL NOT NULL, used_at "
    "REAL NOT NULL, deleted INTEGER NOT NULL DEFAULT 0,"
    " response TEXT NOT NULL, tools TEXT, instructions TEXT, input TEXT NOT NULL, size INTEGER NOT NULL)",
    "CREATE INDEX stored_used_at ON stored (used_at)",
    "CREATE INDEX stored_previous ON stored (previous)",
    # the sweep after each write reads only the deleted
    "CREATE INDEX stored_deleted ON stored (id) WHERE deleted = 1",
    # what the rows and the blobs take, kept by the triggers: no scan a write
    "CREATE TABLE total (bytes INTEGER NOT NULL)",
    "INSERT INTO total VALUES (0)",
    "CREATE TRIGGER stored_in AFTER INSERT ON stored BEGIN UPDATE total SET bytes = bytes + NEW.size; END",
    "CREATE TRIGGER stored_out AFTER DELETE ON stored BEGIN UPDATE total SET bytes = bytes - OLD.size; END",
    "CREATE TRIGGER blobs_in AFTER INSERT ON blobs BEGIN UPDATE total SET bytes = bytes + "
    "LENGTH(NEW.body); END",
    "CREATE TRIGGER blobs_out AFTER DELETE ON blobs BEGIN UPDATE total SET bytes = bytes - "
    "LENGTH(OLD.body); END",
)
_UNNAMED = (
    "DELETE FROM blobs WHERE digest = ? AND NOT EXISTS (SELECT 1 FROM stored WHERE tools = ? OR "
    "instructions = ?)"
)
_DROP = (
    "DROP TABLE IF EXISTS responses",
    "DROP TABLE IF EXISTS stored",
    "DROP TABLE IF EXISTS blobs",
    "DROP TABLE IF EXISTS total",
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
    """A SQLite store of responses. Calls are short and serialised by a lock (the gateway calls them off its
    event loop)."""

    def __init__(self, where: str, retention_s: float, max_bytes: int = 128 * 2**20) -> None:
        self.retention_s, self.max_bytes = retention_s, max_bytes
        self._warned = False  # the cap's warning, once
        self.where = (
            ":memory:"
            if where == MEMORY
            else str(default_path() if where == AUTO else Path(where).expanduser())
        )
        self._lock = threading.Lock()
        try:
            if self.where != ":memory:":
                _private_folder(Path(self.where).parent)
            self._db = sqlite3.connect(self.where, check_same_thread=False, timeout=10, isolation_level=None)
            if self.where != ":memory:":  # before the journal files exist: they take the file's mode
                os.chmod(self.where, 0o600)
            _retried(self._prepare)
        except (OSError, sqlite3.Error) as exc:
            raise ConfigError(
                f"responses.store: cannot open {self.where}: {exc} (give a writable path, memory, or none)"
            ) from None

    def _prepare(self) -> None:
        # takes effect on a new file: freed pages go back at the vacuum after a cleanup
        self._db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        # a deleted response's text is overwritten, not left in free pages
        self._db.execute("PRAGMA secure_delete=ON")
        if self.where != ":memory:":
            # readers beside the writer; several gateways may share a file on one disk
            self._db.execute("PRAGMA journal_mode=WAL")
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            if self._db.execute("PRAGMA user_version").fetchone()[0] != VERSION:
                for statement in (*_DROP, *_SCHEMA, f"PRAGMA user_version={VERSION}"):
                    self._db.execute(statement)

    def put(
        self, response: dict[str, Any], new_items: list[dict[str, Any]], previous: str | None = None
    ) -> None:
        """Keep ``response`` (its output is what it adds to the conversation) and the input items its request
        added after ``previous``'s conversation. One transaction, committed when this returns; ``previous``'s
        chain is touched."""
        now = time.time()
        kept = {k: v for k, v in response.items() if k not in ("tools", "instructions")}
        body, given = json.dumps(kept, separators=(",", ":")), json.dumps(new_items, separators=(",", ":"))
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            digests = [self._blob(response.get(key)) for key in ("tools", "instructions")]
            self._db.execute("DELETE FROM stored WHERE id = ?", (response["id"],))
            self._db.execute(
                "INSERT INTO stored (id, previous, created_at, used_at, response, tools, "
                "instructions, input, size) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (response["id"], previous, now, now, body, *digests, given, len(body) + len(given)),
            )
            if previous is not None:
                self._db.execute(
                    _CHAIN + "UPDATE stored SET used_at = ? WHERE id IN (SELECT id FROM chain)",
                    (previous, now),
                )
            self._clean(now)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """(the response, the conversation it ends), or None (never stored, deleted, past the retention, or a
        response of its chain gone)."""
        with self._lock:
            row = self._row(response_id)
            chain = self._chain(response_id) if row is not None else None
        if row is None or chain is None:
            return None
        return row, [item for given, made in chain for item in given + made]

    def input_items(self, response_id: str) -> list[dict[str, Any]] | None:
        """What the response answered: its chain's conversation, then its own input; None as ``get``."""
        with self._lock:
            chain = self._chain(response_id) if self._row(response_id) is not None else None
        if chain is None:
            return None
        return [item for given, made in chain[:-1] for item in given + made] + chain[-1][0]

    def delete(self, response_id: str) -> bool:
        """Gone for ``GET`` and for chaining; its items stay while a later response's chain runs through
        it."""
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            if (
                self._db.execute(
                    "UPDATE stored SET deleted = 1 WHERE id = ? AND deleted = 0", (response_id,)
                ).rowcount
                == 0
            ):
                return False
            self._sweep(0)
            return True

    def size(self) -> int:
        """Bytes the stored responses and their tools take (what ``max_bytes`` holds)."""
        with self._lock:
            return self._size()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _blob(self, value: Any) -> str | None:
        """``value`` kept once by its digest (an agent sends the same tools and instructions every turn)."""
        if value is None:
            return None
        text = json.dumps(value, separators=(",", ":"))
        digest = hashlib.sha256(text.encode()).hexdigest()
        self._db.execute("INSERT OR IGNORE INTO blobs VALUES (?, ?)", (digest, text))
        return digest

    def _row(self, response_id: str) -> dict[str, Any] | None:
        found = self._db.execute(
            "SELECT s.response, t.body, i.body FROM stored s LEFT JOIN blobs t ON t.digest = "
            "s.tools LEFT JOIN blobs i ON i.digest = s.instructions"
            " WHERE s.id = ? AND s.deleted = 0 AND s.used_at >= ?",
            (response_id, time.time() - self.retention_s),
        ).fetchone()
        if found is None:
            return None
        return {
            **json.loads(found[0]),
            "tools": json.loads(found[1] or "[]"),
            "instructions": json.loads(found[2] or "null"),
        }

    def _chain(self, response_id: str) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]]]] | None:
        """(its input, its output as input items) of each response from the chain's first to ``response_id``;
        None if a link is gone."""
        rows = self._db.execute(
            _CHAIN + "SELECT s.previous, s.input, s.response FROM chain c JOIN stored s ON s.id = c.id "
            "ORDER BY c.depth DESC",
            (response_id,),
        ).fetchall()
        if not rows or rows[0][0] is not None:
            return None
        return [
            (json.loads(row[1]), [as_input(item) for item in json.loads(row[2]).get("output", [])])
            for row in rows
        ]

    def _size(self) -> int:
        return int(self._db.execute("SELECT bytes FROM total").fetchone()[0])

    def _clean(self, now: float) -> None:
        """Past the retention, then the least recently used while over ``max_bytes`` (never the chain this
        write touched: past the cap with it alone, the store holds it and says so); deleted responses no chain
        runs through any more; the tools and instructions no row names; the freed pages."""
        removed = self._db.execute("DELETE FROM stored WHERE used_at < ?", (now - self.retention_s,)).rowcount
        if self._size() > self.max_bytes:
            # a tie: a chain's later responses first
            ordered = (
                "SELECT id, tools, instructions FROM stored WHERE used_at < ? ORDER BY used_at, "
                "created_at DESC"
            )
            for response_id, *digests in self._db.execute(ordered, (now,)).fetchall():
                self._db.execute("DELETE FROM stored WHERE id = ?", (response_id,))
                for digest in digests:  # what only it named goes with it: the total counts it
                    self._db.execute(_UNNAMED, (digest, digest, digest))
                removed += 1
                if self._size() <= self.max_bytes:
                    break
            if self._size() > self.max_bytes and not self._warned:
                self._warned = True
                log.warning(
                    "responses.max_bytes (%d) is smaller than the conversation in use: it is "
                    "kept, over the cap",
                    self.max_bytes,
                )
        self._sweep(removed)

    def _sweep(self, removed: int) -> None:
        """Deleted responses no chain runs through any more (a deleted one's ancestors in turn); then, if
        anything went, the tools and instructions no row names, and the freed pages."""
        while count := self._db.execute(
            "DELETE FROM stored WHERE deleted = 1 AND id NOT IN (SELECT previous FROM stored "
            "WHERE previous IS NOT NULL)"
        ).rowcount:
            removed += count
        if removed:
            self._db.execute(
                "DELETE FROM blobs WHERE digest NOT IN (SELECT tools FROM stored WHERE tools IS "
                "NOT NULL UNION SELECT instructions FROM stored WHERE instructions IS NOT NULL)"
            )
            self._db.execute("PRAGMA incremental_vacuum")


def _private_folder(folder: Path) -> None:
    """``folder`` made 0700 where the store makes it. The file is made 0600 by chmod once SQLite has created
    it: never by opening it here, because closing any descriptor of a database file drops the locks SQLite's
    connections in this process hold on it (POSIX advisory locks), and another gateway's connection in this
    process would corrupt it."""
    try:
        folder.mkdir(parents=True, mode=0o700)
    except FileExistsError:
        pass


def _retried(prepare: Callable[[], None], within_s: float = 10.0) -> None:
    """``prepare()``, again while another process holds the file (gateways starting together on one file):
    switching a new file to WAL takes it whole, and SQLite answers "database is locked" there without waiting
    its busy timeout."""
    deadline, pause = time.monotonic() + within_s, 0.02
    while True:
        try:
            prepare()
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
