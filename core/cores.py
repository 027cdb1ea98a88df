"""The cores this process may use, where every thread default starts: its CPU affinity (``taskset``, a cgroup
cpuset, a pod's pinned CPUs), and no more than its CPU quota (a cgroup's ``cpu.max`` in v2,
``cpu.cfs_quota_us`` in v1: what ``docker run --cpus`` and a Kubernetes CPU limit set). In a container the
affinity alone is every core of the node; threads past the quota are throttled, and llama.cpp's and torch's
slow down many-fold."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def usable_cores(root: Path = CGROUP_ROOT, membership: Path = PROC_CGROUP) -> int:
    """The affinity's cores, capped by the CPU quota rounded down (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity on this platform (macOS)
        cores = os.cpu_count() or 1
    quota = cpu_quota(root, membership)
    return cores if quota is None else max(1, min(cores, math.floor(quota)))


def cpu_quota(root: Path = CGROUP_ROOT, membership: Path = PROC_CGROUP) -> float | None:
    """The CPUs this process's cgroups allow it (the tightest quota from its own cgroup up to the root), or
    None where none is set or none can be read."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            quotas += [_v2(folder / "cpu.max") for folder in _up(root, path)]
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own hierarchy
            mount = next(
                (root / name for name in (controllers, "cpu,cpuacct", "cpu") if (root / name).is_dir()), None
            )
            quotas += [_v1(folder) for folder in _up(mount, path)] if mount is not None else []
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def _up(mount: Path, path: str) -> list[Path]:
    """The cgroup's folder under ``mount`` and each parent up to the mount (a container sees its own cgroup as
    ``/``)."""
    parts = [p for p in path.strip("/").split("/") if p]
    return [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _v2(cpu_max: Path) -> float | None:
    try:
        quota, period = cpu_max.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
