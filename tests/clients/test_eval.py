"""``specgate eval`` against a real uvicorn gateway (tiny draft, fake workers below it): every
setting gets a row; lossy ones carry a measured distance within their bound (the relaxed
ones their acceptance change against the strict row); a setting the
gateway cannot serve is skipped with its reason; the JSON matches the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.server import create_app
from clients.cli import build_parser, main
from clients.eval import evaluate
from core.runners import ModelRunner
from tests.app.fakes import FakeWorkerTransport
from tests.app.helpers import gateway_config, served


def test_every_mode_gets_a_row(
    tiny_runner: ModelRunner, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fakes = FakeWorkerTransport(tiny_runner.fingerprint)
    app = create_app(
        gateway_config(limits={"max_tokens": 16, "max_prompt_tokens": 100}),
        draft_runner=tiny_runner,
        transport=fakes.transport(),
    )
    out = tmp_path / "eval.json"
    with served(app) as url:
        args = build_parser().parse_args(
            ["eval", "--url", url, "--prompts", "2", "--seeds", "1", "--max-tokens", "8", "--json", str(out)]
        )
        assert evaluate(args) == 0
    table = capsys.readouterr().out
    rows = {r["setting"]: r for r in json.loads(out.read_text())["rows"]}
    relaxed = {
        "aggregate k=full relaxed τ≤0.5": "aggregate k=full",
        "exact relaxed τ≤0.5": "exact",
        "exact relaxed τ≤0.9": "exact",
    }
    assert set(rows) == {
        "autoregressive",
        "aggregate k=full",
        "aggregate k=32",
        "aggregate k=8",
        "aggregate k=8 residual",
        "split",
        "exact",
        *relaxed,
    }
    assert "split verifies on one worker" in rows["split"]["skipped"] and "skipped" in table
    assert (
        rows["autoregressive"]["acceptance"] is None and rows["autoregressive"]["mean_accepted_length"] == 1
    )
    for name in ("aggregate k=full", "exact"):
        assert (
            rows[name]["lossless"] is True and rows[name]["tv_bound"] is None and rows[name]["tokens"] == 16
        )
    lossy = rows["aggregate k=8"]
    assert lossy["lossless"] is False and 0 <= lossy["tv_measured"] <= lossy["tv_bound"] + 1e-9
    assert 0 <= lossy["acceptance"] <= 1 and lossy["mean_accepted_length"] >= 1
    # renormalize: TV(p̂_n, p_n) = σ_n exactly
    assert lossy["tv_measured"] == pytest.approx(lossy["tv_bound"])
    assert "aggregate k=8" in table and "TV bound" in table
    for name, strict in relaxed.items():
        # DSD's relaxed verification: lossy by exactly τ(1 − β), at most τ_max / 4
        row, tau_max = rows[name], float(name.rsplit("≤", 1)[1])
        assert row["lossless"] is False and row["strict"] == strict and row["tokens"] == 16
        assert 0 <= row["tau_mean"] <= tau_max and row["tv_bound"] == pytest.approx(tau_max / 4)
        assert (
            row["tv_measured"] == pytest.approx(row["relaxed_tv"])
            and 0 <= row["tv_measured"] <= row["tv_bound"]
        )
        assert row["acceptance_change"] == pytest.approx(row["acceptance"] - rows[strict]["acceptance"])


def test_no_gateway_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--url", "http://127.0.0.1:1"]) == 1
    assert "no gateway at http://127.0.0.1:1" in capsys.readouterr().err
