"""Every process ``specgate serve`` starts gets its share of the cores, for its model and for
torch's pool (issue 33: three processes each with a pool of every core made scoring 20×
slower): the split for one, two and three local workers and for pipeline stages; a process
given N threads runs torch and llama.cpp on N, and reports both on ``/health``."""

from __future__ import annotations

import httpx
import pytest

from clients.procs import WorkerProcess, child_env
from core.config import parse_config


def _workers(n: int, remote: int = 0) -> dict[str, object]:
    local = [{"name": f"w{i}", "model": "builtin", "port": 8101 + i} for i in range(n)]
    return {
        "draft": {"model": "builtin-draft"},
        "workers": [*local, *({"url": f"http://10.0.0.{i}:8101"} for i in range(remote))],
    }


@pytest.mark.parametrize(("local", "cores", "share"), [(1, 2, 2), (2, 2, 1), (3, 2, 1), (2, 8, 4), (3, 8, 2)])
def test_local_workers_and_the_draft_split_the_cores(local: int, cores: int, share: int) -> None:
    config = parse_config(_workers(local, remote=1)).with_split_cores(cores)
    assert [w.threads for w in config.workers if w.is_local] == [share] * local
    # another machine's cores are its own
    assert [w.threads for w in config.workers if not w.is_local] == [None]
    assert config.draft.threads == share


def test_pipeline_stages_split_the_cores_and_a_given_count_is_kept() -> None:
    data = {
        "draft": {"model": "builtin-draft", "threads": 3},
        "speculative": {"mode": "pipeline"},
        "workers": [
            {
                "name": "pipe",
                "pipeline": [{"model": "builtin", "layers": f"{a}:{a + 10}"} for a in (0, 10, 20)]
                + ["http://10.0.0.9:8113"],
            }
        ],
    }
    config = parse_config(data).with_split_cores(6)
    stages = config.workers[0].pipeline or []
    assert [s.threads for s in stages if s.is_local] == [2, 2, 2] and config.draft.threads == 3


def test_a_remote_only_config_leaves_the_draft_every_core() -> None:
    config = parse_config(_workers(0, remote=2)).with_split_cores(4)
    assert config.draft.threads is None
    assert config.draft.background_prefill_wait is False  # a late draft's prefill goes beside the targets'


@pytest.mark.parametrize(("given", "wait"), [(None, True), (False, False)])
def test_with_local_workers_a_late_drafts_prefill_waits_for_the_first_round(
    given: bool | None, wait: bool
) -> None:
    """The cores are the workers' too: the draft's prefill beside theirs would slow the first token
    (app.engine.late)."""
    data = _workers(1, remote=1)
    data["draft"] = {"model": "builtin-draft", "background_prefill_wait": given}
    assert parse_config(data).with_split_cores(2).draft.background_prefill_wait is wait


@pytest.mark.parametrize(
    ("urls", "wait"),
    [
        (["http://127.0.0.1:8101", "http://localhost:8102"], True),
        (["http://127.0.0.1:8101", "http://10.0.0.2:8101"], False),
    ],
)
def test_a_gateway_whose_workers_are_all_on_this_machine_lets_the_first_round_prefill_alone(
    urls: list[str], wait: bool
) -> None:
    assert parse_config({"workers": [{"url": url} for url in urls]}).late_prefill_waits() is wait


def test_the_childs_environment_sizes_its_pools() -> None:
    assert child_env(None) is None
    env = child_env(3)
    assert env is not None and env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3" and "PATH" in env


@pytest.mark.integration
def test_a_worker_given_one_thread_runs_llama_cpp_and_torch_on_one() -> None:
    with WorkerProcess("builtin", "llama.cpp", threads=1) as url:
        assert httpx.get(f"{url}/health", timeout=10).json()["threads"] == {"model": 1, "torch": 1}
