"""The responses store (app/responses_api/store.py) on its own: a chain holds each item once and the tools
once, a conversation reads back whole and in order, the size cap drops the least recently used first and keeps
a chain in use whole, a deletion keeps what a later chain runs through, and the file is the user's alone."""

from __future__ import annotations

import json
import multiprocessing
import stat
import threading
from pathlib import Path
from typing import Any

from app.responses_api.store import ResponseStore

# ~20 KB, as the CLI's
TOOLS = [
    {
        "type": "function",
        "name": f"tool_{i}",
        "description": "Does a thing. " * 20,
        "parameters": {"type": "object"},
    }
    for i in range(60)
]


def _turn(
    store: ResponseStore, n: int, previous: str | None, tools: list[dict[str, Any]] = TOOLS, chain: str = "a"
) -> str:
    response_id = f"resp_{chain}{n}"
    asked = [{"type": "message", "role": "user", "content": f"question {n} " * 20}]
    answered = [
        {
            "id": f"msg_{chain}{n}",
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": f"answer {n} " * 20}],
        }
    ]
    store.put(
        {
            "id": response_id,
            "object": "response",
            "tools": tools,
            "instructions": "You are a coding agent. " * 400,
            "output": answered,
        },
        asked,
        previous,
    )
    return response_id


def test_a_50_turn_chain_holds_each_item_once(tmp_path: Path) -> None:
    """Issue 75: each row held the whole conversation and the tools, O(n²) over a chain (~20 KB of tools per
    row)."""
    store = ResponseStore(str(tmp_path / "r.sqlite3"), retention_s=3600)
    previous = None
    sizes = []
    for n in range(50):
        previous = _turn(store, n, previous)
        sizes.append(store.size())
    per_turn = [b - a for a, b in zip(sizes, sizes[1:])]
    # linear: a turn's items; tools, instructions once
    assert (
        max(per_turn) - min(per_turn) < 100
        and max(per_turn) < 2_000
        and sizes[0] > len(json.dumps(TOOLS)) + 9_000
    )
    found = store.get(previous or "")
    assert found is not None
    response, conversation = found
    assert (
        response["tools"] == TOOLS
        and response["instructions"].startswith("You are")
        and len(conversation) == 100
    )
    assert [
        item["content"] if isinstance(item["content"], str) else item["content"][0]["text"]
        for item in conversation[:2]
    ] == ["question 0 " * 20, "answer 0 " * 20]
    assert store.input_items(previous or "") == conversation[:-1]
    assert store.input_items("resp_a0") == [
        {"type": "message", "role": "user", "content": "question 0 " * 20}
    ]


def test_the_cap_drops_the_least_recently_used_and_keeps_a_chain_in_use_whole(tmp_path: Path) -> None:
    store = ResponseStore(str(tmp_path / "r.sqlite3"), retention_s=3600, max_bytes=17_600)
    old = _turn(store, 0, None, tools=[], chain="old")
    previous = _turn(store, 0, None, tools=[], chain="a")
    for n in range(1, 13):  # 13 turns and the instructions fit; with the other conversation they do not
        previous = _turn(store, n, previous, tools=[], chain="a")
        assert store.size() <= 17_600
        assert store.get(previous) is not None and len(store.get(previous)[1]) == 2 * (n + 1)  # type: ignore[index]
    assert store.get(old) is None  # the other conversation, unused since, went first
    for n in range(13, 20):
        # past the cap with the chain alone: it stays whole (and over the cap), its newest too
        previous = _turn(store, n, previous, tools=[], chain="a")
        assert store.get(previous) is not None and len(store.get(previous)[1]) == 2 * (n + 1)  # type: ignore[index]


def test_a_deleted_response_is_gone_but_a_later_chain_through_it_is_whole(tmp_path: Path) -> None:
    store = ResponseStore(str(tmp_path / "r.sqlite3"), retention_s=3600)
    first = _turn(store, 0, None)
    second = _turn(store, 1, first)
    assert store.delete(first) and not store.delete(first) and store.get(first) is None
    assert store.get(second) is not None and len(store.get(second)[1]) == 4  # type: ignore[index]
    assert store.delete(second) and store.get(second) is None
    # neither is held for a chain any more: both gone, and their tools and instructions
    assert store.size() < 100


def test_the_file_and_its_folder_are_the_users_alone(tmp_path: Path) -> None:
    where = tmp_path / "state" / "specgate" / "r.sqlite3"
    store = ResponseStore(str(where), retention_s=3600)
    _turn(store, 0, None)
    assert stat.S_IMODE(where.stat().st_mode) == 0o600 and stat.S_IMODE(where.parent.stat().st_mode) == 0o700
    for journal in where.parent.glob("r.sqlite3-*"):
        assert stat.S_IMODE(journal.stat().st_mode) & 0o077 == 0, journal
    store.close()


def test_the_cap_counts_what_a_dropped_response_alone_named(tmp_path: Path) -> None:
    """A response whose tools or instructions no other names takes them with it: dropping the oldest is
    enough."""
    store = ResponseStore(str(tmp_path / "r.sqlite3"), retention_s=3600, max_bytes=30_000)
    for n in range(3):
        store.put({"id": f"resp_{n}", "instructions": f"{n} " * 4_500, "output": []}, [], None)
    store.put({"id": "resp_3", "instructions": "3 " * 4_500, "output": []}, [], None)
    assert [store.get(f"resp_{n}") is not None for n in range(4)] == [False, True, True, True]


def _gateways(where: str, process: int) -> list[str]:
    """Three gateways of one process opening, writing and closing one store file, side by side: the errors
    they met."""
    errors: list[str] = []

    def gateway(n: int) -> None:
        for turn in range(10):
            try:
                store = ResponseStore(where, retention_s=3600)
                store.put({"id": f"resp_{process}_{n}_{turn}", "output": []}, [], None)
                store.close()
            except Exception as exc:  # noqa: BLE001 - each error is the finding
                errors.append(repr(exc))

    threads = [threading.Thread(target=gateway, args=(n,)) for n in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_gateways_in_processes_share_a_file_without_breaking_it(tmp_path: Path) -> None:
    """Opening a store once closed a descriptor of the database file to set its mode, which drops the locks
    the other connections of its process hold on it (POSIX), so another process wrote under them: "disk I/O
    error", then "database disk image is malformed"."""
    where = str(tmp_path / "shared" / "r.sqlite3")
    with multiprocessing.get_context("fork").Pool(3) as pool:
        errors = [e for found in pool.starmap(_gateways, [(where, p) for p in range(3)]) for e in found]
    assert errors == []
    assert ResponseStore(where, retention_s=3600).get("resp_2_2_9") is not None
