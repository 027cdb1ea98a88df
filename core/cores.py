"""The cores this process may use: its CPU affinity (``taskset``, a cgroup cpuset, a pod's CPUs), else all; every thread default starts here."""

from __future__ import annotations

import os


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity on this platform (macOS)
        return os.cpu_count() or 1
