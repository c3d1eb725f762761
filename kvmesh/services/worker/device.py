"""Where a worker runs: the device, its default dtype, how much of its memory the KV pool gets,
and what the device reports about its own health.

- `resolve_device("auto" | "cpu" | "cuda" | "cuda:N")`: auto is CUDA when torch sees a device.
- `default_dtype`: on CUDA bfloat16 unless `--dtype` says otherwise; on the CPU the checkpoint's.
- `default_step_tokens`: tokens per step when not given, served and in the in-process engine.
- KV memory on CUDA follows vLLM's `--gpu-memory-utilization`: the fraction of the device's memory
  this worker may use in all. Weights are loaded, one step of the largest size is run to measure
  the activations' peak, and the KV pool takes what remains of the budget (`kv_cache_bytes`), so a
  step never runs out of memory later. On the CPU the pool is `--kv-memory-mib`.
- `DeviceMonitor` reads memory, utilization, temperature, ECC and XID errors through pynvml (the
  `gpu` extra). An uncorrected ECC error or a critical XID event is a device error: the worker
  reports it in `WorkerInfo.device_error`, its scheduler's health check fails on it, and the
  worker is drained and replaced as for any failed check. On the CPU: resident memory only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvmesh.services.config import UnusableSetting

log = logging.getLogger("kvmesh.worker")

GIB = 1 << 30


class DeviceError(UnusableSetting):
    """A device setting this machine cannot honour; the message names the flag."""


def resolve_device(spec: str) -> torch.device:
    """The torch device for `--device`; ValueError naming the flag when it cannot be used here."""
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise DeviceError(f"device: {spec!r} asked for, but torch sees no CUDA device here "
                             f"(torch {torch.__version__}, built {'with' if torch.version.cuda else 'without'} CUDA)")
        index = spec.partition(":")[2]
        if index and not index.isdigit():
            raise DeviceError(f"device: {spec!r} is not cuda:N")
        n = int(index) if index else torch.cuda.current_device()
        if n >= torch.cuda.device_count():
            raise DeviceError(f"device: {spec!r}, but only {torch.cuda.device_count()} CUDA device(s) are visible")
        return torch.device("cuda", n)
    raise DeviceError(f"device: must be auto, cpu, cuda or cuda:N, got {spec!r}")


def default_dtype(device: torch.device, asked: str | None) -> str | None:
    """`--dtype` when given; else bfloat16 on CUDA and the checkpoint's own (None) on the CPU."""
    if asked:
        return asked
    return "bfloat16" if device.type == "cuda" else None


def default_step_tokens(device: torch.device, dtype: torch.dtype, offline: bool = False) -> int:
    """Tokens per step for a model on `device` in `dtype` when not given: the scheduler service's
    for a worker that reports it (`WorkerInfo.step_tokens`, where `--max-batched-tokens` is 0), and
    with `offline` the in-process engine's (`kvmesh offline`, `LLMEngine`). 1,024
    (`DEFAULT_STEP_TOKENS`), but 2,048 for bfloat16 on a CPU with AMX. There oneDNN's tile kernels,
    which take a prompt step's products, multiply 512-1,024 rows at about half their speed at 256
    or 2,048 (Intel Xeon with AMX, two threads, three of the benchmark model's four shapes: 1.2-1.5
    TFLOP/s against 2.3-2.9); the engine issue's offline workload ran 1.05-1.13x faster in
    2,048-token steps, and served at 8 requests/s with TTFT p50 7-15% lower (docs/benchmarks.md).
    Elsewhere larger steps gain little per prompt token and decode every running request half as
    often, so a server keeps 1,024; offline, where no stream waits on a decode, bfloat16 takes
    2,048 wherever the CPU multiplies it natively (AVX512-BF16: 2-3% more output tok/s on the
    engine issue's workload, AMD EPYC Zen 4), as vLLM's CPU build takes larger steps offline
    (4,096) than served (2,048). float32 keeps 1,024 offline too (2,048 gave 3% less there)."""
    from kvmesh.kernels import native
    from kvmesh.kernels.linear import native_half_products
    from kvmesh.services.scheduler.core import DEFAULT_STEP_TOKENS

    if device.type == "cpu" and dtype == torch.bfloat16:
        if native.amx_tiles() or (offline and native_half_products(dtype)):
            return 2048
    return DEFAULT_STEP_TOKENS


def kv_cache_bytes(total: int, free_at_start: int, free_after_profile: int, activation_peak: int,
                   utilization: float) -> int:
    """The KV pool's share of a device under `--gpu-memory-utilization`: the budget
    (`utilization * total`) less what this worker took before the pool (weights, CUDA context,
    library workspaces: `free_at_start - free_after_profile`) and the activations' peak of its
    largest step. ValueError, naming the flag, when the device has less free memory than the
    budget at start (another process holds it) or nothing is left for the KV pool."""
    if not 0.0 < utilization <= 1.0:
        raise DeviceError(f"gpu_memory_utilization: must be in (0, 1], got {utilization}")
    budget = int(utilization * total)
    if free_at_start < budget:
        raise DeviceError(f"gpu_memory_utilization: {utilization} asks for {budget / GIB:.2f} GiB of the device's "
                         f"{total / GIB:.2f} GiB, but only {free_at_start / GIB:.2f} GiB are free "
                         f"(another process holds the rest): lower it")
    taken = max(0, free_at_start - free_after_profile)
    kv = budget - taken - activation_peak
    if kv <= 0:
        raise DeviceError(f"gpu_memory_utilization: {utilization} ({budget / GIB:.2f} GiB) leaves nothing for the KV "
                         f"cache after the weights and workspaces ({taken / GIB:.2f} GiB) and the activations' "
                         f"peak ({activation_peak / GIB:.2f} GiB): raise it, or use a smaller model or step")
    return kv


@dataclass(frozen=True)
class MemoryPlan:
    """What a worker's device memory goes to, measured at start (bytes)."""

    weights: int
    activations_peak: int
    kv_cache: int

    def describe(self) -> str:
        return (f"weights {self.weights / GIB:.2f} GiB, activations peak {self.activations_peak / GIB:.2f} GiB, "
                f"KV cache {self.kv_cache / GIB:.2f} GiB")


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# XID events that mean the device can no longer be trusted (NVIDIA's XID catalogue): 48 double-bit
# ECC error, 63/64 ECC page retirement, 74 NVLink error, 79 fallen off the bus, 92 high single-bit
# ECC rate, 94/95 contained/uncontained ECC error, 119/120 GSP errors.
CRITICAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})


class DeviceMonitor:
    """Memory in use and in total, and the device's own error reports.

    On CUDA (through pynvml): this process's device memory on its own device (found by UUID,
    since NVML ignores CUDA_VISIBLE_DEVICES) against the device's total; where NVML cannot see
    the process (a PID namespace), torch's reserved memory. Utilization, temperature, uncorrected
    ECC errors and critical XID events feed the gauges and `error()`. On the CPU: this process's
    resident memory against the machine's, and no device errors."""

    def __init__(self, device: torch.device | None = None):
        import psutil

        self.process = psutil.Process()
        self.machine_total = psutil.virtual_memory().total
        self.nvml_handle = None
        self.events = None
        self.xid: int | None = None  # the first critical XID seen; it stays (the device is suspect for good)
        device = device if device is not None else torch.device("cpu")
        if device.type != "cuda":
            return
        self.device = device
        try:
            import pynvml

            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            self.nvml_handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            self.nvml = pynvml
        except Exception as e:  # pynvml not installed (the `gpu` extra), or no driver library
            log.warning("GPU health and memory through NVML unavailable: %s", e)
            self.nvml_handle = None
            return
        try:
            self.events = pynvml.nvmlEventSetCreate()
            pynvml.nvmlDeviceRegisterEvents(self.nvml_handle, pynvml.nvmlEventTypeXidCriticalError, self.events)
        except Exception as e:  # not every device or driver supports event registration
            log.info("XID events unavailable: %s", e)
            self.events = None

    @property
    def on_gpu(self) -> bool:
        return self.nvml_handle is not None

    def resident(self) -> int:
        return self.process.memory_info().rss

    def gpu_used(self) -> int:
        for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.nvml_handle):
            if p.pid == self.process.pid and p.usedGpuMemory:
                return int(p.usedGpuMemory)
        return int(torch.cuda.memory_reserved(self.device))

    def read(self) -> tuple[int, int]:
        if self.nvml_handle is not None:
            return self.gpu_used(), int(self.nvml.nvmlDeviceGetMemoryInfo(self.nvml_handle).total)
        return self.resident(), self.machine_total

    def utilization(self) -> float:
        return float(self.nvml.nvmlDeviceGetUtilizationRates(self.nvml_handle).gpu)

    def temperature(self) -> float:
        return float(self.nvml.nvmlDeviceGetTemperature(self.nvml_handle, self.nvml.NVML_TEMPERATURE_GPU))

    def ecc_uncorrected(self) -> int:
        """Uncorrected ECC errors since the driver loaded (0 where the device has no ECC)."""
        try:
            return int(self.nvml.nvmlDeviceGetTotalEccErrors(
                self.nvml_handle, self.nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, self.nvml.NVML_VOLATILE_ECC))
        except self.nvml.NVMLError:  # ECC not supported or disabled
            return 0

    def _poll_xid(self) -> None:
        while self.events is not None and self.xid is None:
            try:
                event = self.nvml.nvmlEventSetWait_v2(self.events, 0)
            except self.nvml.NVMLError:  # timeout: no event pending
                return
            if event.eventType == self.nvml.nvmlEventTypeXidCriticalError and int(event.eventData) in CRITICAL_XIDS:
                self.xid = int(event.eventData)

    def error(self) -> str:
        """Why the device cannot be trusted, or "" (always "" on the CPU)."""
        if self.nvml_handle is None:
            return ""
        return device_error(self.ecc_uncorrected(), self._xid_now())

    def _xid_now(self) -> int | None:
        try:
            self._poll_xid()
        except Exception as e:
            log.warning("reading XID events failed: %s", e)
        return self.xid

    def export(self, metrics) -> None:
        metrics.memory.labels(metrics.worker, "resident").set_function(self.resident)
        if self.nvml_handle is None:
            return
        metrics.memory.labels(metrics.worker, "gpu_used").set_function(self.gpu_used)
        metrics.memory.labels(metrics.worker, "gpu_total").set_function(lambda: self.read()[1])
        metrics.gpu_utilization.labels(metrics.worker).set_function(self.utilization)
        metrics.gpu_temperature.labels(metrics.worker).set_function(self.temperature)
        metrics.gpu_ecc_uncorrected.labels(metrics.worker).set_function(self.ecc_uncorrected)
        metrics.gpu_xid.labels(metrics.worker).set_function(lambda: self._xid_now() or 0)


def device_error(ecc_uncorrected: int, xid: int | None) -> str:
    """The health verdict on a device's error counters: "" when it can be trusted."""
    problems = []
    if ecc_uncorrected > 0:
        problems.append(f"{ecc_uncorrected} uncorrected ECC error(s)")
    if xid is not None:
        problems.append(f"critical XID {xid}")
    return "; ".join(problems)
