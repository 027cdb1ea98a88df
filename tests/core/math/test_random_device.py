"""The random streams where a step's rows are (issue 73): ``philox_uniforms`` is the host's Philox-4x32-10 bit
for bit (every purpose, positions past 2³², lanes to 2³² − 1), a round short is caught; a one-row cumulative
sum on a device is scanned beside a second row (a GPU scans one row with another kernel than many: a seeded
call's draws may not depend on what shares its step), seen on the ``meta`` device, while the CPU keeps its
one-row scan."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import core.math.random as streams
from core.math.batched_sampling import RowParams, apply_sampling_rows
from core.math.random import Purpose, _uniform, philox_uniforms, row_cumsum, sample_rows, stream_key


def _grid(count: int = 4000) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[float]]:
    rng = random.Random(7)
    keys, positions, lanes, want = [], [], [], []
    edges = [0, 1, 2**31, 2**32 - 1, 2**32, 2**40 + 3, 2**52]
    for i in range(count):
        key = stream_key(
            rng.randrange(2**63), rng.randrange(4), list(Purpose)[i % len(Purpose)], rng.randrange(3)
        )
        position = edges[i % len(edges)] if i % 3 == 0 else rng.randrange(2**33)
        lane = [0, 1, 2**32 - 1][i % 3] if i % 5 == 0 else 0
        (
            keys.append(key),
            positions.append(position),
            lanes.append(lane),
            want.append(_uniform(key, position, lane)),
        )
    return torch.tensor(keys), torch.tensor(positions), torch.tensor(lanes), want


def test_the_device_philox_is_the_hosts_bit_for_bit() -> None:
    keys, positions, lanes, want = _grid()
    got = philox_uniforms(keys, positions, lanes)
    assert got.dtype == torch.float64 and torch.equal(got, torch.tensor(want, dtype=torch.float64))
    assert torch.equal(
        philox_uniforms(keys[:5], positions[:5]),
        torch.tensor(
            [_uniform(tuple(k), p) for k, p in zip(keys[:5].tolist(), positions[:5].tolist())],
            dtype=torch.float64,
        ),
    )


def test_a_philox_a_round_short_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = streams._mulhilo
    calls = {"n": 0}

    def short(a: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the tenth round's products taken as the ninth's inputs
        calls["n"] += 1
        return (x, x) if calls["n"] > 18 else real(a, x)

    monkeypatch.setattr(streams, "_mulhilo", short)
    keys, positions, lanes, want = _grid(50)
    assert not torch.equal(philox_uniforms(keys, positions, lanes), torch.tensor(want, dtype=torch.float64))


class _Scans(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket.__name__ == "cumsum":
            self.rows.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_a_one_row_scan_on_a_device_takes_the_many_row_kernel(device: str) -> None:
    probs = torch.rand(1, 50, device=device)
    with _Scans() as scans:
        row_cumsum(probs)
        sample_rows(probs, torch.rand(1, dtype=torch.float64, device=device))
        apply_sampling_rows(
            probs.log(),
            RowParams(
                *(torch.tensor(v, device=device) for v in ([0.8], [0], [0.9], [0.0])), frozenset({"top_p"})
            ),
        )
    assert scans.rows == ([2, 2, 2] if device == "meta" else [1, 1, 1])
    if device == "cpu":
        assert torch.equal(row_cumsum(probs), torch.cumsum(probs, dim=-1))
