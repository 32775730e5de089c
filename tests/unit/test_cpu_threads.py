"""The engine's CPU compute threads: the rule, its overrides, the usable cores, and applying it."""
from __future__ import annotations

import logging

import pytest
import torch

from kestrel.config import EngineConfig
from kestrel.config_resolve import resolve_config
from kestrel.engine.cpu_threads import (WAIT_POLICY, auto_threads, choose_cpu_threads, configure_cpu_threads,
                                        usable_cores)


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 2), (3, 3), (4, 3), (8, 7), (9, 7), (64, 62)])
def test_auto_keeps_cores_for_the_server_only_where_there_are_several(cores, threads):
    decision = choose_cpu_threads("cpu", cores)
    assert auto_threads(cores) == threads
    assert decision.threads == threads and decision.cores == cores
    assert decision.wait_policy == WAIT_POLICY == "PASSIVE"
    assert decision.reason.startswith(f"auto: {cores - threads} core")


def test_the_flag_wins_over_omp_num_threads_which_wins_over_auto():
    assert choose_cpu_threads("cpu", 16, requested=3, env_threads=5).threads == 3
    assert choose_cpu_threads("cpu", 16, requested=3, env_threads=5).reason == "--cpu-threads"
    assert choose_cpu_threads("cpu", 16, env_threads=5).threads == 5
    assert choose_cpu_threads("cpu", 16, env_threads=5).reason == "OMP_NUM_THREADS"
    more = choose_cpu_threads("cpu", 2, requested=4)
    assert more.threads == 4 and "more threads than usable cores (2)" in more.reason


def test_tensor_parallel_ranks_share_the_threads():
    assert choose_cpu_threads("cpu", 16, tp_size=2).threads == 7
    assert choose_cpu_threads("cpu", 2, tp_size=2).threads == 1
    assert choose_cpu_threads("cpu", 2, tp_size=4, requested=2).threads == 1  # never 0
    assert "shared among 2 tensor-parallel ranks" in choose_cpu_threads("cpu", 16, tp_size=2).reason


def test_a_users_wait_policy_is_kept_and_cuda_keeps_torchs_defaults():
    assert choose_cpu_threads("cpu", 4, env_wait_policy="ACTIVE").wait_policy is None
    cuda = choose_cpu_threads("cuda:0", 16, requested=3)
    assert cuda.threads is None and cuda.wait_policy is None and "torch's default" in cuda.reason


def test_usable_cores_follow_affinity_and_the_cgroup_quota(tmp_path, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert usable_cores(tmp_path) == 4  # no cgroup files: the affinity
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # v2: 1.5 cores of time
    assert usable_cores(tmp_path) == 2
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(tmp_path) == 4
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")  # v1: 1 core
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cores(tmp_path) == 1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert usable_cores(tmp_path) == 4


def test_configure_sets_torch_threads_and_logs_once(monkeypatch, caplog):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    config = EngineConfig.from_flat(device="cpu", cpu_threads=1)
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="kestrel.engine.cpu_threads"):
            decision = configure_cpu_threads(config)
        assert torch.get_num_threads() == decision.threads == 1
    finally:
        torch.set_num_threads(before)
    (line,) = [r.getMessage() for r in caplog.records]
    # torch is loaded in this process already: the log says the wait policy came too late, and it is not set.
    assert line.startswith("CPU threads: 1 compute threads on ") and "(--cpu-threads)" in line
    assert "PASSIVE not applied: torch was loaded before the engine chose" in line


def test_a_bad_omp_num_threads_or_flag_is_an_error_naming_it(monkeypatch, tmp_path):
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS must be a positive integer, got 'many'"):
        configure_cpu_threads(EngineConfig.from_flat(device="cpu"))
    with pytest.raises(ValueError, match="cpu_threads must be >= 1"):
        resolve_config(EngineConfig.from_flat(model="demo", device="cpu", cpu_threads=0))
