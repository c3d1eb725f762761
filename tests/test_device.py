"""Where a worker runs: device flags, the KV budget under --gpu-memory-utilization, device health."""

import pytest
import torch

from kvmesh.services.config import UnusableSetting, WorkerConfig
from kvmesh.kernels.linear import small_rows_only
from kvmesh.services.worker import device
from kvmesh.services.worker.model import CausalLM
from kvmesh.services.worker.runner import KVPool, ModelRunner

GIB = 1 << 30


def test_auto_and_cpu_run_on_the_cpu_here_and_cuda_is_refused_naming_the_flag():
    assert device.resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert device.resolve_device("auto").type == "cuda"
        return
    assert device.resolve_device("auto") == torch.device("cpu")
    for spec in ("cuda", "cuda:0"):
        with pytest.raises(UnusableSetting, match="device: 'cuda.*' asked for, but torch sees no CUDA device"):
            device.resolve_device(spec)


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "cuda:", "tpu"])
def test_a_malformed_device_is_refused_when_the_configuration_is_read(spec):
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        WorkerConfig(device=spec)


@pytest.mark.parametrize("fields, message", [
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be in \\(0, 1\\], got 0.0"),
    ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization must be in \\(0, 1\\], got 1.2"),
    ({"kv_memory_mib": -1}, "kv_memory_mib must be >= 0, got -1"),
    ({"max_step_tokens": 0}, "max_step_tokens must be >= 1, got 0"),
])
def test_memory_settings_out_of_range_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        WorkerConfig(**fields)


def test_bfloat16_is_the_default_on_cuda_and_the_checkpoints_dtype_on_the_cpu():
    assert device.default_dtype(torch.device("cuda", 0), None) == "bfloat16"
    assert device.default_dtype(torch.device("cuda", 0), "float32") == "float32"
    assert device.default_dtype(torch.device("cpu"), None) is None
    assert device.default_dtype(torch.device("cpu"), "bfloat16") == "bfloat16"


def test_the_kv_cache_gets_what_the_budget_leaves_after_weights_workspaces_and_activations():
    # An 80 GiB device with 79 GiB free; the worker took 16 GiB (weights, context) and its largest
    # step peaks 3 GiB above that: at 0.9, 72 - 16 - 3 = 53 GiB of KV.
    kv = device.kv_cache_bytes(total=80 * GIB, free_at_start=79 * GIB, free_after_profile=63 * GIB,
                               activation_peak=3 * GIB, utilization=0.9)
    assert kv == int(0.9 * 80 * GIB) - 16 * GIB - 3 * GIB
    # Whatever the pool gets still fits in what was free, with the activations' peak on top.
    assert kv + 3 * GIB <= 63 * GIB


def test_a_budget_the_device_cannot_give_or_that_leaves_nothing_is_refused_naming_the_flag():
    with pytest.raises(UnusableSetting, match="gpu_memory_utilization: 0.9 asks for 72.00 GiB .* only 40.00 GiB are free"):
        device.kv_cache_bytes(80 * GIB, 40 * GIB, 40 * GIB, 0, 0.9)
    with pytest.raises(UnusableSetting, match="leaves nothing for the KV cache"):
        device.kv_cache_bytes(80 * GIB, 80 * GIB, 20 * GIB, 10 * GIB, 0.5)


def test_device_errors_are_named_and_a_clean_device_has_none():
    assert device.device_error(0, None) == ""
    assert device.device_error(3, None) == "3 uncorrected ECC error(s)"
    assert device.device_error(0, 79) == "critical XID 79"
    assert device.device_error(1, 48) == "1 uncorrected ECC error(s); critical XID 48"


def test_on_the_cpu_the_monitor_reads_resident_memory_and_reports_no_device_error():
    monitor = device.DeviceMonitor(torch.device("cpu"))
    used, total = monitor.read()
    assert 0 < used < total
    assert monitor.error() == "" and not monitor.on_gpu


def test_the_kv_pool_lives_on_the_models_device_and_weights_are_counted(hf_checkpoint):
    model = CausalLM.load(hf_checkpoint("llama"), device="cpu")
    runner = ModelRunner(model, num_pages=8)
    assert runner.pool.k.device == model.device == torch.device("cpu")
    assert runner.pool.nbytes == 8 * 16 * model.cfg.kv_bytes_per_token
    # 2 layers of hidden 64 (q 64, k and v 32 each, o 64x64, MLP 3 x 64x128) and two 512x64 embeddings;
    # the matrices (the LM head one of them) twice where the few-rows kernel keeps a copy beside oneDNN's.
    matrices, table = 2 * (64 * 128 + 64 * 64 + 3 * 64 * 128) + 512 * 64, 512 * 64
    assert model.small_only == (model.small_rows and small_rows_only())
    assert model.weight_bytes() == 4 * (matrices * (2 if model.small_rows and not model.small_only else 1) + table)
    assert KVPool.pages_for_budget(model, runner.pool.nbytes, 16) == 8
