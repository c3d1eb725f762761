"""Service configuration: flags, KVMESH_* variables, and errors for unknown settings."""

import os
import subprocess
import sys


def serve_check(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kvmesh.cli", "serve", *args, "--check"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def test_flags_and_variables_fill_the_config_flag_first():
    proc = serve_check("scheduler", "--max-batched-tokens", "256", env={"KVMESH_MAX_NUM_SEQS": "7", "KVMESH_MAX_BATCHED_TOKENS": "999"})
    assert proc.returncode == 0, proc.stderr
    assert "max_batched_tokens=256" in proc.stdout and "max_num_seqs=7" in proc.stdout


def test_unknown_flag_is_an_error():
    proc = serve_check("worker", "--kv-memroy-mib", "10")
    assert proc.returncode == 2 and "--kv-memroy-mib" in proc.stderr


def test_unknown_variable_is_an_error_naming_it():
    proc = serve_check("router", env={"KVMESH_MODLE": "x"})
    assert proc.returncode == 2 and "unknown setting KVMESH_MODLE" in proc.stderr


def test_badly_typed_variable_names_the_variable():
    proc = serve_check("worker", env={"KVMESH_PAGE_SIZE": "sixteen"})
    assert proc.returncode == 2 and "KVMESH_PAGE_SIZE" in proc.stderr


def test_invalid_scheduler_setting_is_an_error_naming_it():
    proc = serve_check("scheduler", "--worker-choice", "random")
    assert proc.returncode == 2 and "worker_choice" in proc.stderr
    proc = serve_check("scheduler", "--victim-policy", "oldest")
    assert proc.returncode == 2 and "victim_policy" in proc.stderr
    proc = serve_check("scheduler", "--overlap-steps", "true")
    assert proc.returncode == 2 and "overlap_steps must be auto, on or off" in proc.stderr
    proc = serve_check("scheduler", "--min-shared-wait-tokens", "0")
    assert proc.returncode == 2 and "min_shared_wait_tokens must be >= 1, got 0" in proc.stderr


def test_fleet_settings_are_checked_and_errors_name_the_setting():
    import pytest

    from kvmesh.services.config import RouterConfig, SchedulerServiceConfig, WorkerConfig

    cases = [
        (SchedulerServiceConfig, {"autoscale_max_workers": 1}, "autoscale_max_workers must be >= the warm pool size 2"),
        (SchedulerServiceConfig, {"autoscale_tokens_per_worker": 0}, "autoscale_tokens_per_worker must be >= 1"),
        (SchedulerServiceConfig, {"health_check_failures": 0}, "health_check_failures must be >= 1, got 0"),
        (SchedulerServiceConfig, {"memory_limit_fraction": 1.5}, "memory_limit_fraction must be in (0, 1], got 1.5"),
        (WorkerConfig, {"fault_rate": 2.0}, "fault_rate must be between 0 and 1, got 2.0"),
        (WorkerConfig, {"version": " "}, "version must not be empty"),
        (RouterConfig, {"model": "a=/x,a=/y"}, "model names must be distinct"),
        (RouterConfig, {"model": "=/x"}, "model must be DIR or NAME=DIR"),
        (RouterConfig, {"stream_interval": 0}, "stream_interval must be >= 1, got 0"),
        (RouterConfig, {"stream_interval_max_gap_ms": -1.0}, "stream_interval_max_gap_ms must be >= 0, got -1.0"),
    ]
    for cls, settings, message in cases:
        with pytest.raises(ValueError) as e:
            cls(**settings)
        assert message in str(e.value), (settings, str(e.value))


def test_the_step_budget_is_each_workers_own_unless_one_is_given():
    """--max-batched-tokens 0 (the default) takes what each worker reports for its device and dtype
    (2,048 for bfloat16 on a CPU with AMX), a worker that reports none (an older one) gets 1,024,
    and a budget given wins over the worker's."""
    from prometheus_client import CollectorRegistry

    from kvmesh.metrics import SchedulerMetrics
    from kvmesh.services.config import SchedulerServiceConfig
    from kvmesh.services.scheduler.worker_loop import WorkerLoop
    from kvmesh.v1 import worker_pb2

    def budget(given: int, reported: int) -> int:
        info = worker_pb2.WorkerInfo(num_pages=64, page_size=16, max_context=4096, step_tokens=reported)
        loop = WorkerLoop({"id": "w", "address": "w:1"}, info, SchedulerServiceConfig(max_batched_tokens=given), None,
                          SchedulerMetrics(CollectorRegistry()))
        return loop.core.config.max_batched_tokens

    assert [budget(0, 2048), budget(0, 0), budget(512, 2048)] == [2048, 1024, 512]
