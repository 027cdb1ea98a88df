"""``specgate bench dsd``'s arithmetic on hand-made runs: the bound with and without overlap
(a prepared draft counts only when used), the paired ratios, and the verdict on auto."""

from __future__ import annotations

from dataclasses import replace

import pytest

from clients.bench.dsd import auto_verdict, cells, summarise
from clients.bench.floors import Floors, bound_tokens_per_s, physical_bound
from clients.bench.modes import analytic_bound, direct_tokens_per_s, per_round
from core.config import LinkConfig

LINK = LinkConfig(rtt_ms=50, up_mbps=10, down_mbps=10)
FLOORS = Floors(threads=1, draft_step_s=0.010, scoring_s={1: 0.020, 3: 0.030, 5: 0.045, 7: 0.060, 9: 0.080})


def _run(
    tokens_per_s: float,
    rounds: float = 10,
    drafted: float = 40,
    used: float = 0,
    prepared: float = 0,
    gamma_mean: float | None = None,
) -> dict[str, float]:
    run = {
        "tokens_per_s": tokens_per_s,
        "tokens": 27.0,
        "seconds": 27.0 / tokens_per_s,
        "rounds": rounds,
        "drafted": drafted,
        "mean_accepted_length": 27.0 / rounds,
        "acceptance_rate": 0.5,
        "bytes_up_per_round": 400.0,
        "bytes_down_per_round": 700.0,
        "draft_ms_per_token": 30.0,
        "verify_model_ms_per_round": 140.0,
        "prepared": prepared,
        "prepared_used": used,
    }
    if gamma_mean is not None:
        run["gamma_mean"] = gamma_mean
    return run


def test_without_overlap_the_bound_is_the_modes_bench_bound() -> None:
    run = _run(8.0)
    assert bound_tokens_per_s(run, 4, 0.030, LINK, 1) == pytest.approx(analytic_bound(run, 4, LINK, 1))


def test_a_used_prepared_draft_costs_only_what_outlasts_the_flight() -> None:
    flight = LINK.delay_s(400, upstream=True) + LINK.delay_s(700, upstream=False) + 0.140
    plain = 10 * flight + 40 * 0.030
    # prepared, never used: no gain
    assert 27 / bound_tokens_per_s(_run(8.0, prepared=9), 4, 0.030, LINK, 1) == pytest.approx(plain)
    overlapped = 10 * flight + (40 - 3 * 4) * 0.030 + 3 * max(0.0, 5 * 0.030 - flight)
    assert 27 / bound_tokens_per_s(_run(8.0, used=3, prepared=9), 4, 0.030, LINK, 1) == pytest.approx(
        overlapped
    )
    assert overlapped == pytest.approx(plain - 3 * 4 * 0.030)  # a 50 ms link outlasts 5 draft tokens: free
    slow_draft = 10 * flight + (40 - 12) * 0.100 + 3 * (5 * 0.100 - flight)
    assert 27 / bound_tokens_per_s(_run(8.0, used=3, prepared=9), 4, 0.100, LINK, 1) == pytest.approx(
        slow_draft
    )


def test_summary_ratios_and_the_auto_verdict() -> None:
    names = [name for name, _ in cells()]
    assert (
        names[0] == "autoregressive"
        and {"γ=2", "γ=8 overlap", "auto", "auto overlap"} <= set(names)
        and len(names) == 11
    )
    speeds = {
        "autoregressive": 5.0,
        "γ=2": 8.0,
        "γ=2 overlap": 8.8,
        "γ=4": 10.0,
        "γ=4 overlap": 11.0,
        "γ=6": 9.0,
        "γ=6 overlap": 9.0,
        "γ=8": 7.0,
        "γ=8 overlap": 7.0,
        "auto": 9.8,
        "auto overlap": 9.9,
    }
    samples = {
        name: [
            _run(
                speed * factor,
                used=2 if "overlap" in name else 0,
                prepared=8 if "overlap" in name else 0,
                gamma_mean=3.5 if name.startswith("auto") else None,
            )
            for factor in (1.0, 1.1, 0.9)
        ]
        for name, speed in speeds.items()
    }
    rows = {r["cell"]: r for r in summarise(samples, 1, "50 ms", LINK, FLOORS)}
    assert rows["γ=4"]["speedup_vs_autoregressive"] == pytest.approx(2.0)
    assert rows["γ=4 overlap"]["overlap_gain"] == pytest.approx(1.1) and rows["γ=4 overlap"][
        "prepared_used_share"
    ] == pytest.approx(0.25)
    assert rows["auto"]["gamma"] == 3.5 and rows["γ=6"]["gamma"] == 6 and "overlap_gain" not in rows["auto"]
    assert (
        rows["auto"]["auto"] and not rows["autoregressive"]["auto"] and rows["autoregressive"]["gamma"] == 0
    )
    assert 0 < rows["γ=4"]["measured_over_bound"] and rows["γ=4"]["bound_tokens_per_s"] > 0
    verdict = auto_verdict(list(rows.values()))
    by_overlap = {g["overlap"]: g for g in verdict["groups"]}
    assert by_overlap[False]["best_fixed"] == "γ=4" and by_overlap[False][
        "auto_over_best_fixed"
    ] == pytest.approx(0.98)
    assert by_overlap[True]["best_fixed"] == "γ=4 overlap" and by_overlap[True][
        "auto_over_best_fixed"
    ] == pytest.approx(0.9)
    assert verdict["worst"] == pytest.approx(0.9) and verdict["meets_bar"] is False


def test_the_physical_bound_is_the_bound_with_llama_cpps_costs() -> None:
    run = _run(8.0)
    # floors equal to the cell's own costs: the same bound
    own = Floors(threads=1, draft_step_s=0.030, scoring_s={5: 0.140})
    assert physical_bound(run, 4, LINK, 1, own) == pytest.approx(bound_tokens_per_s(run, 4, 0.030, LINK, 1))
    assert physical_bound(per_round(run, 4), 4, LINK, 1, own) == pytest.approx(
        analytic_bound(run, 4, LINK, 1)
    )
    # γ + 1 = 5 positions
    flight = LINK.delay_s(400, upstream=True) + LINK.delay_s(700, upstream=False) + 0.045
    assert physical_bound(run, 4, LINK, 1, FLOORS) == pytest.approx(27 / (10 * flight + 40 * 0.010))
    assert physical_bound(run, 3.4, LINK, 1, FLOORS) == pytest.approx(
        physical_bound(run, 3.4, LINK, 1, replace(FLOORS, scoring_s={3: 0.030, 5: 0.045}))
    )
    ar = physical_bound(_run(5.0, rounds=27, drafted=0), 0.0, LINK, 1, FLOORS)  # one position, no draft
    assert ar == pytest.approx(
        27 / (27 * (LINK.delay_s(400, upstream=True) + LINK.delay_s(700, upstream=False) + 0.020))
    )


def test_the_direct_baseline_pays_the_round_trip_once() -> None:
    floors = replace(FLOORS, direct_step_s=0.010)
    assert direct_tokens_per_s(50, LinkConfig(), floors) == pytest.approx(100.0)  # 1 / step on loopback
    # 50 ms each way of a 100 ms RTT, the request's 2,000 bytes at 10 Mbps, then 50 steps
    seconds = 0.1 + 2_000 * 8 / 10e6 + 50 * 0.010
    assert direct_tokens_per_s(50, LinkConfig(rtt_ms=100, up_mbps=10), floors) == pytest.approx(50 / seconds)
    # a link too slow for the stream: the chunks, not the model, set the pace
    slow = LinkConfig(down_mbps=0.08)  # 200-byte chunks at 80 kbit/s: 20 ms each
    assert direct_tokens_per_s(50, slow, floors) == pytest.approx(50.0)
    assert direct_tokens_per_s(50, LinkConfig(), FLOORS) == 0.0  # not measured: no column
    # 0.5 s + 50 × 10 ms
    assert direct_tokens_per_s(50, LinkConfig(), replace(floors, direct_prefill_s=0.5)) == pytest.approx(50.0)
