"""How many cores this process may use: its CPU affinity (``taskset``, a cgroup cpuset, a pod's pinned
CPUs), else every core. Every default thread count and every split of the cores starts from it."""

from __future__ import annotations

import os


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity on this platform (macOS)
        return os.cpu_count() or 1
