"""The worker on a CUDA device (`pytest -m cuda`, run by bench/gpu_check.sh): skipped where torch
sees no GPU. What runs on the CPU is tested elsewhere (test_triton_kernels.py runs the same kernels
through Triton's interpreter; test_device.py the device settings)."""

import pytest
import torch

from kvmesh.engine import EngineConfig, LLMEngine
from kvmesh.params import SamplingParams, StoppingParams
from kvmesh.services.config import WorkerConfig
from kvmesh.services.scheduler.core import SchedulerConfig
from reference import assert_matches_reference, hf_greedy
from test_engine import random_prompts, run_staggered

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# bfloat16 rounds logits to about 1e-2 and the two sides' matrix products round differently: a
# reference top-two gap under this is a tie either side may break.
TOLERANCE = {"float32": dict(), "bfloat16": dict(tie_gap=0.15, logprob_tol=0.15)}


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_output_on_the_gpu_equals_transformers_on_the_gpu(hf_checkpoint, arch, dtype):
    overrides = {"sliding_window": 24} if arch == "mistral" else {}
    model_dir = hf_checkpoint(arch, **overrides)
    engine = LLMEngine(EngineConfig(model=model_dir, device="cuda", dtype=dtype, num_pages=128,
                                    scheduler=SchedulerConfig(max_batched_tokens=40)))
    assert engine.model.device.type == "cuda" and engine.runner.pool.k.is_cuda
    prompts = random_prompts(8, (5, 90), seed=2)
    reqs = run_staggered(engine, prompts, StoppingParams(max_new_tokens=16, ignore_eos=True), SamplingParams(temperature=0.0))
    compared = sum(assert_matches_reference(r.output_token_ids, r.output_logprobs,
                                            hf_greedy(model_dir, p, 16, getattr(torch, dtype), "cuda"), **TOLERANCE[dtype])
                   for p, r in zip(prompts, reqs))
    print(f"{arch} {dtype}: {compared} tokens compared")
    assert compared >= 4 * 16, compared


def test_sampling_with_penalties_and_logprobs_runs_on_the_host_from_gpu_logits(hf_checkpoint):
    engine = LLMEngine(EngineConfig(model=hf_checkpoint("llama"), device="cuda", num_pages=64))
    params = SamplingParams(temperature=0.8, seed=3, repetition_penalty=1.3, logprobs=3)
    [a] = engine.generate([[5, 6, 7, 8]], params, StoppingParams(max_new_tokens=12, ignore_eos=True))
    [b] = engine.generate([[5, 6, 7, 8]], params, StoppingParams(max_new_tokens=12, ignore_eos=True))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12


def test_the_kv_pool_takes_what_the_memory_budget_leaves_and_a_full_step_fits(model_dir):
    from kvmesh.services.worker.server import load_runner

    free, total = torch.cuda.mem_get_info()
    utilization = min(0.3, 0.9 * free / total)
    runner = load_runner(WorkerConfig(model=str(model_dir), device="cuda", gpu_memory_utilization=utilization,
                                      max_step_tokens=2048))
    assert runner.model.dtype == torch.bfloat16  # the CUDA default
    used = free - torch.cuda.mem_get_info()[0]
    assert used <= utilization * total, (used, utilization * total)  # within the budget
    assert runner.pool.nbytes >= 0.8 * utilization * total - (used - runner.pool.nbytes)  # and most of what it left


def test_the_device_monitor_reads_the_gpu_through_nvml():
    from kvmesh.services.worker.device import DeviceMonitor

    pytest.importorskip("pynvml")
    monitor = DeviceMonitor(torch.device("cuda", torch.cuda.current_device()))
    assert monitor.on_gpu
    used, total = monitor.read()
    assert 0 < used < total
    assert 0.0 <= monitor.utilization() <= 100.0 and monitor.temperature() > 0
    assert monitor.error() == ""
