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
