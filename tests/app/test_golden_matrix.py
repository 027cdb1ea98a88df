"""Golden outputs of every lossless-matrix cell (``tests.app.test_lossless_matrix``): each
configuration the API accepts — every mode, payload, child rule, shape, worker set, sampling,
overlap, secondary option, transform and drafter — run once, seeded, through the real engine on
the Markov fakes, with the real random draws (not enumerated), to ``MAX_TOKENS``. Recorded
before the core is reshaped (issue 47): a refactor keeps every round's tokens, drafted and
accepted counts, the finish, every pipeline turn and every lossy bound **bit for bit** (bounds
to 1e-4, ``tests.matching``). The matrix proves each cell's law; this proves the code still
draws it the same way.

The cells whose draft length follows measured timings (``num_draft_tokens: auto`` unseeded) run
seeded here, as a seeded request does: γ fixed, the controller off.

Re-record only for a deliberate change of numbers, saying why in the commit:
``SPECGATE_RECORD_GOLDEN=1 python -m pytest tests/app/test_golden_matrix.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest
import torch

from app.engine import GenerationRequest
from core.lookup import AcceptanceStats, LookupParams, SuffixIndex
from core.names import Mode
from tests.app.test_lossless_matrix import ALL_CELLS as CELLS
from tests.app.test_lossless_matrix import (
    LOOKUP_TOKENS,
    LOOKUPS,
    MAX_TOKENS,
    TRANSFORMS,
    Cell,
    _cancel_the_rest,
    _engine,
)
from tests.matching import matches

GOLDEN = Path(__file__).parent.parent / "golden" / "matrix.json"
RECORD = os.environ.get("SPECGATE_RECORD_GOLDEN") == "1"
SEED = 5


def _named() -> dict[str, Cell]:
    """The cells by name; a name two cells share (T = 0 makes both sampled rules "greedy") gets
    ``#2`` on the second."""
    out: dict[str, Cell] = {}
    for cell in CELLS:
        name, n = cell.name, 1
        while name in out:
            n += 1
            name = f"{cell.name} #{n}"
        out[name] = cell
    return out


NAMED = _named()


def _output(cell: Cell) -> dict[str, Any]:
    """The cell's seeded answer: per result, [tokens, drafted, accepted, forced, turns, rounds
    ended, bound, relaxed TV], and the finish."""
    engine = _engine(cell)
    engine.draft.lookup.params = LookupParams(max_tokens=LOOKUP_TOKENS)
    engine.draft.lookup.suffixes = SuffixIndex(engine.draft.lookup.params)
    engine.draft.lookup.acceptance = AcceptanceStats()
    for output in LOOKUPS[cell.lookup][1] if cell.lookup else ():
        engine.draft.lookup.suffixes.add(list(output))
    req = GenerationRequest(
        request_id="golden",
        prompt=cell.prompt,
        max_tokens=MAX_TOKENS,
        params=cell.params,
        seed=SEED,
        choice=0,
        spec=cell.spec,
        seeded=cell.lookup != "suffix index" or cell.spec.auto_gamma,
        min_tokens=cell.min_tokens,
        transform=TRANSFORMS.get(cell.transform),
        draft_after=cell.late,
    )

    async def run() -> dict[str, Any]:
        results: list[list[Any]] = []
        finish = None
        async with aclosing(engine.generate(req)) as answers:
            async for r in answers:
                results.append(
                    [
                        list(r.tokens),
                        r.drafted,
                        r.accepted,
                        r.drafting.forced,
                        r.pipeline.turns,
                        r.pipeline.rounds_ended,
                        sum(r.lossy.bound),
                        sum(r.lossy.relaxed_tv),
                    ]
                )
                finish = r.finish_reason or finish
        await _cancel_the_rest()  # a pipeline's segments still in flight
        return {"results": results, "finish": finish}

    loop = asyncio.new_event_loop()
    try:
        return dict(json.loads(json.dumps(loop.run_until_complete(run()))))  # as stored: lists, floats
    finally:
        loop.close()


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    torch.set_num_threads(1)
    if RECORD:
        GOLDEN.write_text(
            "{\n"
            + ",\n".join(
                f"{json.dumps(name, ensure_ascii=False)}: {json.dumps(_output(c), separators=(',', ':'))}"
                for name, c in NAMED.items()
            )
            + "\n}\n"
        )
    return dict(json.loads(GOLDEN.read_text()))


def test_every_cell_is_recorded(golden: dict[str, Any]) -> None:
    assert sorted(golden) == sorted(NAMED)
    assert {o["finish"] for o in golden.values()} == {"stop", "length"}
    # rounds after the first (EOS is one of the four ids)
    assert sum(len(o["results"]) for o in golden.values()) > 3 * len(golden)


@pytest.mark.parametrize(
    "mode", sorted({c.mode for c in CELLS}, key=lambda m: m.value), ids=lambda m: m.value
)
def test_seeded_output_of_every_cell_is_unchanged(golden: dict[str, Any], mode: Mode) -> None:
    changed = [name for name, c in NAMED.items() if c.mode is mode and not matches(_output(c), golden[name])]
    assert not changed, f"{len(changed)} cells changed, e.g. {changed[:5]}"
