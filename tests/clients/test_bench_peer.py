"""``specgate bench peer``'s own logic on figures given: each request's prompt its own, the goals' verdicts,
the table."""

from __future__ import annotations

from typing import Any

from clients.bench import peer


def _rows(autoregressive: float, lookup: float) -> list[dict[str, Any]]:
    rows = []
    for cell in peer.CELLS:
        for set_name in peer.SETS:
            ratio = (
                autoregressive
                if cell == "specgate autoregressive"
                else lookup
                if cell == "specgate exact, lookup drafter"
                else 1.0
            )
            rows.append(
                {
                    "cell": cell,
                    "set": set_name,
                    "tokens_per_s": 50.0 * ratio,
                    "vs_engine": ratio,
                    **({"tokens_per_round": 1.5} if cell in peer.OURS else {}),
                }
            )
    return rows


def test_every_request_gets_a_prompt_of_its_own() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    first, second = peer._marked(messages, 1), peer._marked(messages, 2)
    assert (
        first != second
        and first[1:] == messages[1:]
        and first[0]["content"].endswith("be brief")
        and messages[0]["content"] == "be brief"
    )


def test_the_goals_are_met_only_where_every_ratio_reaches_them() -> None:
    met = {g["cell"]: g["met"] for g in peer._goals(_rows(0.95, 1.6))}
    assert met == {"specgate autoregressive": True, "specgate exact, lookup drafter": True}
    rows = _rows(0.95, 1.6)
    next(r for r in rows if r["cell"] == "specgate autoregressive" and r["set"] == "long")["vs_engine"] = 0.89
    met = {g["cell"]: g["met"] for g in peer._goals(rows)}
    assert met == {"specgate autoregressive": False, "specgate exact, lookup drafter": True}
    assert not next(g for g in peer._goals(_rows(1.0, 1.4)) if g["cell"] == "specgate exact, lookup drafter")[
        "met"
    ]


def test_the_table_prints_every_cell_and_set(capsys: Any) -> None:
    rows = _rows(0.8, 0.6)
    setup = {"max_tokens": 64, "threads": 2, "runs": 1, "prompts": {s: [10, 20] for s in peer.SETS}}
    peer._print({"setup": setup, "cells": rows, "goals": peer._goals(rows)})
    out = capsys.readouterr().out
    assert all(cell in out for cell in peer.CELLS) and all(s in out for s in peer.SETS)
    assert "not met" in out and "(0.80×)" in out and "tokens per round" in out
