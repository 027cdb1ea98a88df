"""Shared fixtures: real models loaded once per test session (they take seconds to load), and
the split of the cores between pytest-xdist's test processes.

``make test`` runs one test process per core (``-n auto``, capped at ``MAX_TEST_PROCESSES``), a
module per process at a time (``--dist loadfile``: a module's fixtures and servers start once),
and pins each process to its own cores: every server a test starts inherits the pin, and
sizes its threads from it (``core.cores.usable_cores``), so two processes' llama.cpp threads
never spin against each other on one core. ``-n 0`` runs everything in one process, unpinned.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

# Some tests run two llama.cpp threads on one pinned core (the numerics one thread cannot show):
# OpenMP's default spin at each barrier then waits out a whole time slice, 10-20x slower.
# Sleeping waiters cost nothing here; it must be set before torch or llama.cpp loads libgomp.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Stored responses (responses.store: auto) in a directory of this run's, not the user's ~/.local/state: every
# gateway a test starts, in this process or as a server, inherits it.
if "SPECGATE_TEST_STATE" not in os.environ:
    import tempfile

    os.environ["SPECGATE_TEST_STATE"] = os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(
        prefix="specgate-test-state-"
    )

import pytest  # noqa: E402
import torch  # noqa: E402

from core.cores import usable_cores
from core.runners import ModelRunner, load_runner

MAX_TEST_PROCESSES = 4  # each starts its own pair of built-in workers (tests/integration/conftest.py)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return max(1, min(MAX_TEST_PROCESSES, usable_cores()))


def _pin_this_test_process() -> None:
    """Under xdist: this process (and every server it starts) on its share of the cores."""
    name, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not name or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if count <= len(cores):
        os.sched_setaffinity(0, cores[int(name.removeprefix("gw")) % count :: count])


_pin_this_test_process()

# The modules in the order of their time (measured: a make test on 2 cores, the modules of 2 s and more; the
# rest after them in collection order): pytest-xdist hands modules out in collection order
# (``--no-loadscope-reorder``: not by their number of tests), and the longest first leaves only short ones for
# the end, where a process that runs out of modules idles while the other finishes its last.
COSTLIEST_FIRST = (  # from 116 s (the matrix) down to 2 s
    "tests/app/test_lossless_matrix.py",
    "tests/clients/test_cli.py",
    "tests/integration/test_gateway_e2e.py",
    "tests/integration/test_long_prompts_real.py",
    "tests/integration/test_structured_real.py",
    "tests/integration/test_pipeline_real.py",
    "tests/integration/test_shared_workers_real.py",
    "tests/integration/test_request_surface.py",
    "tests/app/test_engine.py",
    "tests/integration/test_kubernetes_pods.py",
    "tests/test_device_check.py",
    "tests/integration/test_tool_formats_real.py",
    "tests/workers/test_scheduler.py",
    "tests/app/test_special_markers.py",
    "tests/workers/test_step_syncs.py",
    "tests/core/runners/test_llama_cpp_numerics.py",
    "tests/integration/test_faults_real.py",
    "tests/app/test_schema_fuzz.py",
    "tests/core/runners/test_llama_cpp_runner.py",
    "tests/integration/test_discovery_real.py",
    "tests/integration/test_worker_real.py",
    "tests/integration/test_engine_target.py",
    "tests/app/test_transform_law.py",
    "tests/core/math/test_tree_exact.py",
    "tests/app/test_adaptive.py",
    "tests/app/test_draft.py",
    "tests/integration/test_responses_real.py",
    "tests/app/test_fixed_chains.py",
    "tests/integration/test_golden_builtin.py",
    "tests/app/test_reliability.py",
    "tests/app/test_late_draft.py",
    "tests/core/math/test_tree.py",
    "tests/workers/test_stages.py",
    "tests/core/runners/test_models.py",
    "tests/test_typecheck.py",
    "tests/core/math/test_speculative.py",
    "tests/core/math/test_tree_lookup.py",
    "tests/integration/test_chat_page.py",
    "tests/app/test_server.py",
    "tests/app/test_golden_matrix.py",
    "tests/core/math/test_exact.py",
    "tests/app/test_openai_target.py",
    "tests/clients/test_thread_share.py",
    "tests/core/math/test_relaxed.py",
    "tests/app/test_golden.py",
    "tests/core/runners/test_static_forward.py",
    "tests/workers/test_server.py",
    "tests/app/test_timing.py",
    "tests/core/runners/test_stages.py",
    "tests/clients/test_eval.py",
    "tests/workers/test_server_llama.py",
    "tests/app/test_reasoning.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(COSTLIEST_FIRST)}
    # stable: a module's own order kept
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


# The statistical tests run many tiny tensor ops: one thread avoids the pool's overhead, and
# leaves the other core to the servers the integration tests start.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_runner_shared() -> ModelRunner:
    return load_runner("tiny-random", "transformers")


@pytest.fixture
def tiny_runner(tiny_runner_shared: ModelRunner) -> Iterator[ModelRunner]:
    """The tiny random-weight model, with no sessions left over from another test."""
    tiny_runner_shared.free_all()
    yield tiny_runner_shared
    tiny_runner_shared.free_all()


@pytest.fixture(scope="session")
def builtin_llama_shared() -> ModelRunner:
    return load_runner("builtin", "llama.cpp", memory_cap_mb=512)


@pytest.fixture
def builtin_llama(builtin_llama_shared: ModelRunner) -> Iterator[ModelRunner]:
    builtin_llama_shared.free_all()
    yield builtin_llama_shared
    builtin_llama_shared.free_all()


@pytest.fixture(scope="session")
def builtin_llama_two_threads_shared() -> ModelRunner:
    """The built-in model on two threads (even on one pinned core): llama.cpp's one-token kernel sums a long
    cache in one part per thread, which one thread cannot show
    (tests/core/runners/test_llama_cpp_numerics.py)."""
    return load_runner("builtin", "llama.cpp", threads=2, memory_cap_mb=512)


@pytest.fixture
def builtin_llama_two_threads(builtin_llama_two_threads_shared: ModelRunner) -> Iterator[ModelRunner]:
    builtin_llama_two_threads_shared.free_all()
    yield builtin_llama_two_threads_shared
    builtin_llama_two_threads_shared.free_all()
