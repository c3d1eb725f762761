"""Typed service configuration from CLI flags and `KVMESH_*` variables.

Each service has one frozen dataclass. `add_flags` turns its fields into `--flag-name` options
whose defaults come from `KVMESH_FLAG_NAME` when set; an unknown flag is an argparse error and
an unknown `KVMESH_*` variable is an error naming it. Precedence: flag, then variable, then default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import typing
from dataclasses import dataclass

# Variables read outside service configs (the model cache folder).
GLOBAL_VARIABLES = {"KVMESH_CACHE"}


def env_name(field_name: str) -> str:
    return "KVMESH_" + field_name.upper()


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true/false)")


def field_type(cls: type, name: str) -> type:
    """The type of a config field (annotations are strings under `from __future__ import annotations`)."""
    return typing.get_type_hints(cls)[name]


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds one flag per field of the config dataclass `cls`."""
    for f in dataclasses.fields(cls):
        kind = field_type(cls, f.name)
        parse = _parse_bool if kind is bool else kind
        default = f.default
        env = os.environ.get(env_name(f.name))
        if env is not None:
            try:
                default = parse(env)
            except (ValueError, argparse.ArgumentTypeError) as e:
                parser.error(f"{env_name(f.name)}={env!r}: {e}")
        help_text = f.metadata.get("help", "")
        parser.add_argument("--" + f.name.replace("_", "-"), type=parse, default=default,
                            help=f"{help_text} (env {env_name(f.name)}; default {_shown(f, default)!r})")


def from_args(cls: type, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def known_variables(classes: list[type]) -> set[str]:
    return {env_name(f.name) for cls in classes for f in dataclasses.fields(cls)} | GLOBAL_VARIABLES


def check_environment(classes: list[type]) -> None:
    """Raises ValueError for a KVMESH_* variable that no service setting reads."""
    known = known_variables(classes)
    unknown = sorted(k for k in os.environ if k.startswith("KVMESH_") and k not in known)
    if unknown:
        raise ValueError(f"unknown setting {unknown[0]} (known: {', '.join(sorted(known))})")


def service_environment(service: str, env: dict[str, str]) -> dict[str, str]:
    """`env` without the KVMESH_* variables that `service` does not read: `kvmesh up` runs every
    service from one environment, where a scheduler setting is not an unknown one for the router."""
    known = known_variables(service_classes(service))
    return {k: v for k, v in env.items() if not k.startswith("KVMESH_") or k in known}


def check_checkpoint_folder(field_name: str, folder: str) -> None:
    """ValueError naming the field unless `folder` holds a checkpoint (its config.json)."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        what = "does not exist" if not os.path.exists(folder) else "has no config.json"
        raise ValueError(f"{field_name}: {folder} is not a checkpoint folder (it {what})")


def _help(text: str, secret: bool = False):
    # A secret setting is masked wherever a configuration is shown (`describe`).
    return {"help": text, "secret": secret}


def describe(cfg) -> str:
    """`cfg` as its dataclass repr, but with secrets masked: a secret setting shows as '****'
    and a password inside a URL (redis://user:PASSWORD@host) as ****. For --check and logs."""
    shown = ", ".join(f"{f.name}={_shown(f, getattr(cfg, f.name))!r}" for f in dataclasses.fields(cfg))
    return f"{type(cfg).__name__}({shown})"


def _shown(f: dataclasses.Field, value):
    if f.metadata.get("secret") and value:
        return "****"
    if isinstance(value, str):
        return re.sub(r"(://[^/@:]*:)[^/@]*@", r"\1****@", value)
    return value


class UnusableSetting(ValueError):
    """A well-formed setting this machine cannot honour when the service starts (a CUDA device it
    lacks, a memory budget that does not fit); the message names the flag. `kvmesh serve` prints
    it and exits 2, as for a malformed one."""


@dataclass(frozen=True)
class MeshTLSConfig:
    """A process's identity inside the mesh (every service, and operator tools such as `kvmesh health`)."""

    mesh_ca: str = dataclasses.field(default="", metadata=_help("mTLS inside the mesh: the CA certificate (PEM) peers must be signed by; with --mesh-cert and --mesh-key (default: off, plaintext)"))
    mesh_cert: str = dataclasses.field(default="", metadata=_help("mTLS: this service's certificate (PEM, signed by --mesh-ca; its names must cover the advertised address)"))
    mesh_key: str = dataclasses.field(default="", metadata=_help("mTLS: this service's private key (PEM)"))
    mesh_server_name: str = dataclasses.field(default="", metadata=_help("mTLS: the name every peer's certificate must carry (default: the host of the address dialled; set one shared name when addresses are pod IPs or scaled containers)"))

    def __post_init__(self):
        from kvmesh.services.tls import check_files

        check_files({"mesh_ca": self.mesh_ca, "mesh_cert": self.mesh_cert, "mesh_key": self.mesh_key})


@dataclass(frozen=True)
class CommonConfig(MeshTLSConfig):
    redis_url: str = dataclasses.field(default="redis://127.0.0.1:6379/0", metadata=_help("Redis for registry and state: redis://[[USER]:PASSWORD@]HOST:PORT/DB, rediss:// for TLS (options: kvmesh/services/redis_client.py)"))
    host: str = dataclasses.field(default="127.0.0.1", metadata=_help("address to listen on"))
    advertise_host: str = dataclasses.field(default="", metadata=_help("address others use to reach this service (default: host)"))

    def __post_init__(self):
        from kvmesh.services.redis_client import check_redis_url

        super().__post_init__()
        check_redis_url(self.redis_url)


@dataclass(frozen=True)
class WorkerConfig:
    port: int = dataclasses.field(default=50054, metadata=_help("gRPC port (0: pick a free one)"))
    worker_id: str = dataclasses.field(default="", metadata=_help("stable id (default: host:port)"))
    model: str = dataclasses.field(default="", metadata=_help("checkpoint folder (default: the generated default model)"))
    device: str = dataclasses.field(default="auto", metadata=_help("auto, cpu, cuda or cuda:N (auto: CUDA when torch sees a device)"))
    dtype: str = dataclasses.field(default="", metadata=_help("float32, bfloat16 or float16 (default: bfloat16 on CUDA, the checkpoint's on the CPU)"))
    kv_memory_mib: int = dataclasses.field(default=0, metadata=_help("KV cache memory (0: 1024 on the CPU; on CUDA what --gpu-memory-utilization leaves)"))
    gpu_memory_utilization: float = dataclasses.field(default=0.9, metadata=_help("CUDA: the fraction of the device's memory this worker uses in all (weights, activations, KV cache)"))
    max_step_tokens: int = dataclasses.field(default=8192, metadata=_help("CUDA: the largest step the memory profile runs (keep >= the scheduler's --max-batched-tokens)"))
    kv_offload_mib: int = dataclasses.field(default=0, metadata=_help("host-memory tier for KV pages evicted from the pool, read back instead of recomputed (0: none)"))
    page_size: int = dataclasses.field(default=16, metadata=_help("tokens per KV page"))
    threads: int = dataclasses.field(default=0, metadata=_help("torch threads (0: on a CPU, the team its steps measure fastest: every core, or fewer while fewer measure faster)"))
    pool: str = dataclasses.field(default="default", metadata=_help("model pool (the model name clients ask for)"))
    version: str = dataclasses.field(default="v1", metadata=_help("model version within the pool (canary rollouts split traffic by version)"))
    fault_rate: float = dataclasses.field(default=0.0, metadata=_help("TESTING ONLY: fail this fraction of requests (chosen by a hash of the request id) at their first token"))
    fault_kill_after_pages: int = dataclasses.field(default=0, metadata=_help("TESTING ONLY: SIGKILL this worker after it has sent this many KV pages to peers (0: never)"))
    fault_kill_after_fetched_pages: int = dataclasses.field(default=0, metadata=_help("TESTING ONLY: SIGKILL this worker after it has written this many KV pages fetched from a peer or its tier (0: never)"))

    def __post_init__(self):
        if self.model:
            check_checkpoint_folder("model", self.model)
        spec = self.device.strip().lower()
        if not (spec in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", spec)):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_memory_mib < 0:
            raise ValueError(f"kv_memory_mib must be >= 0, got {self.kv_memory_mib}")
        if self.kv_offload_mib < 0:
            raise ValueError(f"kv_offload_mib must be >= 0, got {self.kv_offload_mib}")
        if self.max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")
        if not 0.0 <= self.fault_rate <= 1.0:
            raise ValueError(f"fault_rate must be between 0 and 1, got {self.fault_rate}")
        for name in ("pool", "version"):
            if not getattr(self, name).strip():
                raise ValueError(f"{name} must not be empty")
    metrics_port: int = dataclasses.field(default=9104, metadata=_help("Prometheus /metrics HTTP port (0: pick a free one; -1: off)"))


@dataclass(frozen=True)
class SchedulerServiceConfig:
    port: int = dataclasses.field(default=50052, metadata=_help("gRPC port (0: pick a free one)"))
    metrics_port: int = dataclasses.field(default=9102, metadata=_help("Prometheus /metrics HTTP port (0: pick a free one; -1: off)"))
    pool: str = dataclasses.field(default="default", metadata=_help("the model pool whose workers this scheduler batches for"))
    health_check_interval_s: float = dataclasses.field(default=30.0, metadata=_help("inference and memory check of every worker this often (0: off)"))
    health_check_failures: int = dataclasses.field(default=3, metadata=_help("consecutive failed checks that drain and replace a worker"))
    memory_limit_fraction: float = dataclasses.field(default=0.95, metadata=_help("memory check: fail above this fraction of the worker's memory (device memory on CUDA)"))
    admission_ramp_s: float = dataclasses.field(default=10.0, metadata=_help("a worker that joins later takes up to max_num_seqs over this long (0: at once)"))
    worker_lease_s: float = dataclasses.field(default=2.0, metadata=_help("TTL of this scheduler's lease on each worker it owns (renewed every third); a dead scheduler's workers are adopted by the pool's other schedulers about this long after its death"))
    autoscale_tokens_per_worker: int = dataclasses.field(default=4000, metadata=_help("autoscaling: estimated queued tokens one worker absorbs"))
    autoscale_ttft_slo_s: float = dataclasses.field(default=2.0, metadata=_help("autoscaling: add a worker while TTFT p95 is above this"))
    autoscale_rate_per_worker: float = dataclasses.field(default=1.0, metadata=_help("autoscaling: requests/s one worker sustains"))
    autoscale_peak_rate: float = dataclasses.field(default=0.0, metadata=_help("autoscaling: peak requests/s expected; sizes the warm pool"))
    autoscale_min_workers: int = dataclasses.field(default=1, metadata=_help("autoscaling: fewest workers"))
    autoscale_max_workers: int = dataclasses.field(default=8, metadata=_help("autoscaling: most workers"))
    autoscale_scale_down_delay_s: float = dataclasses.field(default=300.0, metadata=_help("autoscaling: a lower count must hold this long before scaling down"))
    max_batched_tokens: int = dataclasses.field(default=0, metadata=_help("tokens per step (0: what each worker reports for its device and dtype: 1024, or 2048 for bfloat16 on a CPU with AMX)"))
    max_num_seqs: int = dataclasses.field(default=128, metadata=_help("running sequences per worker"))
    victim_policy: str = dataclasses.field(default="newest", metadata=_help("newest, priority or size"))
    max_prefill_chunk: int = dataclasses.field(default=512, metadata=_help("prefill tokens one request may take per step (0: the whole budget); leaves room for short requests beside a long prompt"))
    aging_s: float = dataclasses.field(default=10.0, metadata=_help("a waiting request gains one priority point per this many seconds (0: off)"))
    batching: str = dataclasses.field(default="continuous", metadata=_help("continuous; static (the baseline: a batch runs until its longest request ends, finished rows still decoding as in a padded batch); static-unpadded (finished rows leave the batch)"))
    overlap_steps: str = dataclasses.field(default="auto", metadata=_help("continuous batching: send the next step's plan while the worker computes the current one, so the worker never waits for the scheduler between steps (a request that ends on a token sampled in the step out, EOS or a stop token, has one more token computed and discarded): on, off, or auto (on for workers on an accelerator, and for a CPU worker whose steps its thread tuner found faster on fewer threads than cores beside the rest of the mesh, a small model's (the worker's step results say so); off for other CPU workers, where the scheduler's work would take the cores the worker's step runs on)"))
    max_queue_len: int = dataclasses.field(default=1024, metadata=_help("waiting requests at most; more get RESOURCE_EXHAUSTED"))
    max_queue_wait_s: float = dataclasses.field(default=300.0, metadata=_help("a request that could not start within this long is refused at once (RESOURCE_EXHAUSTED with a retry hint, estimated from the requests ahead of it and the worker's measured step rates), and one that waits this long all the same is refused then (0: no limit)"))
    prefix_caching: bool = dataclasses.field(default=True, metadata=_help("share prompt prefixes"))
    kv_fetch: str = dataclasses.field(default="auto", metadata=_help("read a prompt's KV pages from a peer worker or the worker's host-memory tier instead of computing them: auto (when the measured transfer rate beats the measured prefill rate), always (whenever they are held), never"))
    worker_choice: str = dataclasses.field(default="kv", metadata=_help("kv (prefix overlap vs load) or round-robin"))
    prefill_weight: float = dataclasses.field(default=1.0, metadata=_help("kv choice: cost per prompt page to prefill"))
    load_weight: float = dataclasses.field(default=0.05, metadata=_help("kv choice: cost per page of queued work"))
    balance_ratio: float = dataclasses.field(default=0.5, metadata=_help("kv choice: allowed load above the least loaded worker, as a fraction of its load (a worker's load leaves out the request's prompt pages still queued there, and counts those it lacks and has no room for)"))
    balance_slack_pages: float = dataclasses.field(default=32.0, metadata=_help("kv choice: allowed load above the least loaded worker, in pages, at least"))
    min_shared_wait_tokens: int = dataclasses.field(default=256, metadata=_help("a waiting request waits for prompt pages a running request on its worker is computing (the same system prompt), instead of computing them too, when at least this many of its tokens would come from them"))
    backlog_decode_every: int = dataclasses.field(default=2, metadata=_help("while requests wait that there is room to admit, running requests decode first in one step of this many, and the other steps give the waiting prompts the budget first (1: decodes first in every step, as vLLM; 2: each running request still decodes at least every other step, and a backlog of prompts gets the share of the machine the other decodes took: lower time to first token under load, longer pauses in streams)"))
    detach_grace_s: float = dataclasses.field(default=30.0, metadata=_help("a request whose client named its request_id runs on this long after its stream drops (router or client gone), its tokens kept, for the client to resume it (GenerateRequest.resume_from); then it is cancelled and its pages freed"))

    def __post_init__(self):
        # The cores check their own settings; building them here reports a bad one at start (and under --check).
        from kvmesh.services.scheduler.placement import PlacementConfig

        self.core_config()
        if self.overlap_steps not in ("auto", "on", "off"):
            raise ValueError(f"overlap_steps must be auto, on or off, got {self.overlap_steps!r}")
        if self.kv_fetch not in ("auto", "always", "never"):
            raise ValueError(f"kv_fetch must be auto, always or never, got {self.kv_fetch!r}")
        if self.max_queue_len < 1 or self.max_queue_wait_s < 0:
            raise ValueError(f"max_queue_len must be >= 1 and max_queue_wait_s >= 0, got {self.max_queue_len} and {self.max_queue_wait_s}")
        PlacementConfig(self.worker_choice, self.prefill_weight, self.load_weight, self.balance_ratio, self.balance_slack_pages)
        if self.health_check_interval_s < 0:
            raise ValueError(f"health_check_interval_s must be >= 0, got {self.health_check_interval_s}")
        if self.health_check_failures < 1:
            raise ValueError(f"health_check_failures must be >= 1, got {self.health_check_failures}")
        if not 0 < self.memory_limit_fraction <= 1:
            raise ValueError(f"memory_limit_fraction must be in (0, 1], got {self.memory_limit_fraction}")
        if self.admission_ramp_s < 0:
            raise ValueError(f"admission_ramp_s must be >= 0, got {self.admission_ramp_s}")
        if self.detach_grace_s < 0:
            raise ValueError(f"detach_grace_s must be >= 0, got {self.detach_grace_s}")
        if not 0.3 <= self.worker_lease_s <= 60:
            raise ValueError(f"worker_lease_s must be in [0.3, 60], got {self.worker_lease_s}")
        self.autoscale_policy()

    def autoscale_policy(self):
        """The pool's AutoscalePolicy; its errors name these settings (autoscale_*), not the policy's fields."""
        import re

        from kvmesh.fleet.autoscale import AutoscalePolicy

        try:
            return AutoscalePolicy(self.autoscale_tokens_per_worker, self.autoscale_ttft_slo_s,
                                   self.autoscale_rate_per_worker, self.autoscale_peak_rate, self.autoscale_min_workers,
                                   self.autoscale_max_workers, self.autoscale_scale_down_delay_s)
        except ValueError as e:
            names = {"tokens_per_worker": "autoscale_tokens_per_worker", "ttft_p95_slo_s": "autoscale_ttft_slo_s",
                     "rate_per_worker": "autoscale_rate_per_worker", "peak_expected_rate": "autoscale_peak_rate",
                     "min_workers": "autoscale_min_workers", "max_workers": "autoscale_max_workers",
                     "scale_down_delay_s": "autoscale_scale_down_delay_s"}
            raise ValueError(re.sub(r"\b(" + "|".join(names) + r")\b", lambda m: names[m.group(1)], str(e))) from None

    def core_config(self, worker_step_tokens: int = 0):
        """The scheduler core's settings for a worker that reports `worker_step_tokens` (0: none)."""
        from kvmesh.services.scheduler.core import SchedulerConfig

        return SchedulerConfig(self.max_batched_tokens or worker_step_tokens or None, self.max_num_seqs, self.victim_policy,
                               self.aging_s, self.batching, self.max_prefill_chunk, self.min_shared_wait_tokens,
                               self.backlog_decode_every)


@dataclass(frozen=True)
class KVCacheServiceConfig:
    port: int = dataclasses.field(default=50053, metadata=_help("gRPC port (0: pick a free one)"))
    metrics_port: int = dataclasses.field(default=9103, metadata=_help("Prometheus /metrics HTTP port (0: pick a free one; -1: off)"))
    max_pages_per_worker: int = dataclasses.field(default=1 << 20, metadata=_help("the largest KV pool (in pages) a worker may report; Publish refuses more (its prefix index costs about 100 bytes per indexed page)"))

    def __post_init__(self):
        if self.max_pages_per_worker < 1:
            raise ValueError(f"max_pages_per_worker must be >= 1, got {self.max_pages_per_worker}")


@dataclass(frozen=True)
class RouterConfig:
    port: int = dataclasses.field(default=50051, metadata=_help("gRPC port (0: pick a free one)"))
    model: str = dataclasses.field(default="", metadata=_help("the pools' checkpoint folders (their tokenizers): DIR, or NAME=DIR[,NAME=DIR...] for several pools (default: the default model)"))
    model_name: str = dataclasses.field(default="default", metadata=_help("the pool name clients use in GenerateRequest.model when --model is a plain DIR"))
    served_model_name: str = dataclasses.field(default="", metadata=_help("more names the one pool answers to, comma-separated (as vLLM's --served-model-name); a pool started from a folder also answers to the folder's path as given"))
    no_worker_wait_s: float = dataclasses.field(default=5.0, metadata=_help("a request for a pool with no ready worker waits this long, then UNAVAILABLE"))
    http_port: int = dataclasses.field(default=8000, metadata=_help("HTTP port: OpenAI-compatible API, /health, /ready, /metrics (0: pick a free one; -1: off)"))
    api_keys: str = dataclasses.field(default="", repr=False, metadata=_help("comma-separated API keys; when set, callers must send `authorization: Bearer KEY` (HTTP header or gRPC metadata)", secret=True))
    api_keys_file: str = dataclasses.field(default="", metadata=_help("API keys with per-key limits: a JSON (or .toml) file mapping each key to {id, requests_per_s, tokens_per_min, max_concurrent}; read again when it changes or on SIGHUP (docs/security.md)"))
    tls_cert: str = dataclasses.field(default="", metadata=_help("TLS on the public ports (gRPC and HTTP): the server certificate chain (PEM), with --tls-key (default: plaintext; the mesh's own mTLS is --mesh-*)"))
    tls_key: str = dataclasses.field(default="", metadata=_help("TLS on the public ports: the private key of --tls-cert (PEM)"))
    max_request_bytes: int = dataclasses.field(default=8 << 20, metadata=_help("largest request body (HTTP, then 413) or message (gRPC, then RESOURCE_EXHAUSTED)"))
    max_prompt_chars: int = dataclasses.field(default=1 << 20, metadata=_help("longest prompt text, all chat messages together, in characters; checked before tokenizing (400 above it)"))
    scheduler_choice: str = dataclasses.field(default="kv", metadata=_help("which scheduler of a pool with several takes a request: kv (the one whose worker holds the longest cached prefix of the prompt, weighed against the work this router has in flight there; docs/kvcache.md) or round-robin"))
    route_balance_ratio: float = dataclasses.field(default=0.5, metadata=_help("scheduler choice's balance guard: only schedulers whose in-flight work (less the request's prompt pages a request sent there just before it is still to compute, plus those its roomiest worker lacks and has no room for) is within max(route_balance_slack_pages, this x the least loaded one's) of it are candidates, so a hot prefix spreads"))
    route_balance_slack_pages: float = dataclasses.field(default=64.0, metadata=_help("scheduler choice's balance guard: the smallest allowed gap, in pages of work"))
    resume_timeout_s: float = dataclasses.field(default=30.0, metadata=_help("a request whose scheduler or worker died is resubmitted (with the tokens already streamed) to a live scheduler, retried with backoff for this long, then UNAVAILABLE"))
    stream_interval: int = dataclasses.field(default=1, metadata=_help("tokens per streamed message after the first (gRPC responses, SSE chunks): 1 sends each token as it comes; N sends the first at once, then one message per N tokens (sooner when tokens come slowly: --stream-interval-max-gap-ms), and the rest with the finish, so clients and the router handle fewer messages (as vLLM's --stream-interval; a request's stream_interval may raise it)"))
    stream_interval_max_gap_ms: float = dataclasses.field(default=50.0, metadata=_help("under a stream interval above 1, a token that came this long or longer after the one before goes out at once with those held: holding pays only while tokens come fast, and a stream whose steps are slow (a burst of prompts) would wait the interval's count of slow steps for its text (0: hold for the count whatever the gaps, as vLLM does)"))
    drain_s: float = dataclasses.field(default=30.0, metadata=_help("on SIGTERM the router takes no new calls (gRPC UNAVAILABLE, the HTTP port closed, health NOT_SERVING) and lets the calls in flight on both ports finish for up to this long, then ends them (a gRPC client with a request_id resumes through another router)"))

    def __post_init__(self):
        from kvmesh.services.router.pools import parse_models, served_names
        from kvmesh.services.tls import check_files

        check_files({"tls_cert": self.tls_cert, "tls_key": self.tls_key})
        self.key_book()  # a bad keys file is reported at start (and under --check)

        pools = parse_models(self.model, self.model_name)
        served_names(pools, self.served_model_name)
        for _, folder in pools:
            if folder:
                check_checkpoint_folder("model", folder)
        if self.no_worker_wait_s < 0:
            raise ValueError(f"no_worker_wait_s must be >= 0, got {self.no_worker_wait_s}")
        if self.resume_timeout_s < 0:
            raise ValueError(f"resume_timeout_s must be >= 0, got {self.resume_timeout_s}")
        if self.drain_s < 0:
            raise ValueError(f"drain_s must be >= 0, got {self.drain_s}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if not self.stream_interval_max_gap_ms >= 0:  # NaN too
            raise ValueError(f"stream_interval_max_gap_ms must be >= 0, got {self.stream_interval_max_gap_ms}")
        if self.scheduler_choice not in ("kv", "round-robin"):
            raise ValueError(f"scheduler_choice must be kv or round-robin, got {self.scheduler_choice!r}")
        if self.route_balance_ratio < 0 or self.route_balance_slack_pages < 0:
            raise ValueError(f"route_balance_ratio and route_balance_slack_pages must be >= 0, "
                             f"got {self.route_balance_ratio} and {self.route_balance_slack_pages}")
        if self.max_request_bytes < 1024 or self.max_prompt_chars < 1:
            raise ValueError(f"max_request_bytes must be >= 1024 and max_prompt_chars >= 1, "
                             f"got {self.max_request_bytes} and {self.max_prompt_chars}")

    def key_book(self):
        """The API keys of --api-keys and --api-keys-file; ValueError naming the file when it is bad."""
        from kvmesh.services.router.limits import KeyBook

        return KeyBook(self.api_keys, self.api_keys_file)


SERVICE_CONFIGS = {"router": RouterConfig, "scheduler": SchedulerServiceConfig, "kvcache": KVCacheServiceConfig,
                   "worker": WorkerConfig}


def service_classes(service: str) -> list[type]:
    """The config classes whose settings `kvmesh serve SERVICE` reads."""
    return [CommonConfig, SERVICE_CONFIGS[service]]
