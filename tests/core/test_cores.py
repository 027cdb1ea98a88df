"""The cores a process may use (core.cores): its affinity, capped by its cgroup's CPU quota, read from fake
cgroup trees as a container sees them (v2's ``cpu.max``, v1's ``cpu.cfs_quota_us``), the tightest from its own
cgroup up."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from core.cores import cpu_quota, usable_cores


def _tree(root: Path, files: dict[str, str], membership: str) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "self-cgroup").write_text(membership)
    return root / "self-cgroup"


@pytest.mark.parametrize(
    "files, membership, quota",
    [
        # a pod's limit, above
        (
            {"kubepods/pod1/ctr/cpu.max": "max 100000\n", "kubepods/pod1/cpu.max": "150000 100000\n"},
            "0::/kubepods/pod1/ctr\n",
            1.5,
        ),
        ({"cpu.max": "400000 100000\n"}, "0::/\n", 4.0),  # a container sees its own cgroup as the root
        ({"cpu.max": "max 100000\n"}, "0::/\n", None),  # no limit: a Kubernetes request without a limit
        (
            {
                "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000\n",
                "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
            },
            "4:cpu,cpuacct:/docker/abc\n",
            2.0,
        ),
        # v1 without a quota
        (
            {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
            "4:cpu,cpuacct:/\n",
            None,
        ),
        ({"cpu.max": "garbage\n"}, "0::/\n", None),
        ({}, "0::/\n", None),
    ],
)
def test_the_quota_is_the_tightest_a_cgroup_sets(
    tmp_path: Path, files: dict[str, str], membership: str, quota: float | None
) -> None:
    assert cpu_quota(tmp_path, _tree(tmp_path, files, membership)) == quota


def test_threads_follow_the_quota_where_the_affinity_is_the_whole_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 76: a pod that requests 4 CPUs on a 96-core node ran torch with 96 threads."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(96)))
    assert usable_cores(tmp_path, _tree(tmp_path, {"cpu.max": "400000 100000\n"}, "0::/\n")) == 4
    # half a CPU: one thread
    assert usable_cores(tmp_path, _tree(tmp_path, {"cpu.max": "50000 100000\n"}, "0::/\n")) == 1
    assert usable_cores(tmp_path, _tree(tmp_path, {"cpu.max": "max 100000\n"}, "0::/\n")) == 96
    assert usable_cores(tmp_path, tmp_path / "no-such-file") == 96
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    # pinned to fewer: the affinity
    assert usable_cores(tmp_path, _tree(tmp_path, {"cpu.max": "400000 100000\n"}, "0::/\n")) == 2
