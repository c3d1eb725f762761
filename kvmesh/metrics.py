"""Prometheus metrics, one class per service, named `kvmesh_*` and shaped like vLLM's where they mean
the same (`vllm:time_to_first_token_seconds` is `kvmesh_time_to_first_token_seconds` here, with the
same `model_name` label and bucket edges; vLLM's `:` is a name promtool refuses outside recording rules).

Each service builds only its own class, so its /metrics shows its own series. Every class takes
a registry (tests use a fresh one); services use prometheus-client's default registry, which also
carries the process collector (`process_resident_memory_bytes`, CPU seconds, open files).
Every counter has its series from the start, at 0 (`rate()` over a quiet service is 0, not empty):
the router's per served model, the scheduler's per worker as the worker joins. `promtool check
metrics` passes on every service (no `_created` series, no gauge named `_total`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()  # a `_created` gauge per series doubles the output and is no dashboard's

# Bucket edges follow vLLM's so dashboards built for it read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0)
TOKEN_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


# Finish reasons and gRPC codes a router counts; their series exist at 0 from the start.
FINISH_REASONS = ("length", "stop", "eos", "cancelled", "error")
FAILURE_CODES = ("INVALID_ARGUMENT", "UNAUTHENTICATED", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED",
                 "CANCELLED", "INTERNAL", "UNKNOWN")


KEY_OUTCOMES = ("admitted", "requests_per_s", "tokens_per_min", "max_concurrent")


class RouterMetrics:
    """Per request, as the client sees it (gRPC and HTTP alike). Prefill, decode and inference times
    are vLLM's, from the finish's timings: first token minus queue time, last token minus first,
    last token minus queue time."""

    def __init__(self, registry: CollectorRegistry = REGISTRY):
        m = ("model_name",)
        self.ttft = Histogram("kvmesh_time_to_first_token_seconds", "Time from request arrival to its first token.",
                              m, buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram("kvmesh_inter_token_latency_seconds", "Time between consecutive output tokens of a request.",
                             m, buckets=ITL_BUCKETS, registry=registry)
        self.tpot = Histogram("kvmesh_time_per_output_token_seconds",
                              "Per request: (end-to-end - time to first token) / (output tokens - 1).",
                              m, buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram("kvmesh_e2e_request_latency_seconds", "Time from request arrival to its last token.",
                             m, buckets=REQUEST_BUCKETS, registry=registry)
        self.queue = Histogram("kvmesh_request_queue_time_seconds", "Time a request waited in the scheduler's queue.",
                               m, buckets=REQUEST_BUCKETS, registry=registry)
        self.prompt_len = Histogram("kvmesh_request_prompt_tokens", "Prompt length of finished requests.",
                                    m, buckets=TOKEN_COUNT_BUCKETS, registry=registry)
        self.output_len = Histogram("kvmesh_request_generation_tokens", "Output length of finished requests.",
                                    m, buckets=TOKEN_COUNT_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("kvmesh_prompt_tokens", "Prompt tokens of finished requests.", m, registry=registry)
        self.generation_tokens = Counter("kvmesh_generation_tokens", "Output tokens streamed.", m, registry=registry)
        self.success = Counter("kvmesh_request_success", "Requests finished, by finish reason.",
                               (*m, "finished_reason"), registry=registry)
        self.failure = Counter("kvmesh_request_failure", "Requests that ended with a gRPC error, by status code.",
                               (*m, "code"), registry=registry)
        self.in_flight = Gauge("kvmesh_requests_in_flight", "Streams open at the router.", m, registry=registry)
        self.cancelled = Counter("kvmesh_request_cancelled", "Requests whose client left or cancelled before the finish.",
                                 m, registry=registry)
        self.prefill_time = Histogram("kvmesh_request_prefill_time_seconds",
                                      "Time from leaving the queue to the first token.", m, buckets=REQUEST_BUCKETS,
                                      registry=registry)
        self.decode_time = Histogram("kvmesh_request_decode_time_seconds", "Time from the first token to the last.",
                                     m, buckets=REQUEST_BUCKETS, registry=registry)
        self.inference_time = Histogram("kvmesh_request_inference_time_seconds",
                                        "Time from leaving the queue to the last token (prefill plus decode).",
                                        m, buckets=REQUEST_BUCKETS, registry=registry)
        self.max_tokens = Histogram("kvmesh_request_params_max_tokens", "max_tokens (max_new_tokens) of finished requests.",
                                    m, buckets=TOKEN_COUNT_BUCKETS, registry=registry)
        self.prefix_lookups = Counter("kvmesh_router_prefix_lookups", "Prefix-index lookups for choosing a scheduler, "
                                      "by outcome: hit (a scheduler's worker holds a prefix), miss, or unavailable "
                                      "(kvcache did not answer in time: chosen by load).", (*m, "outcome"), registry=registry)
        self.schedulers = Gauge("kvmesh_router_schedulers", "Schedulers the router sends the pool's new requests "
                                "to: registered, reachable and owning a worker, as of its last discovery round.",
                                m, registry=registry)
        self.resumes = Counter("kvmesh_router_resumes", "Running requests resubmitted by the router after their "
                               "scheduler call broke, by cause: scheduler (the call or its scheduler session broke: "
                               "the scheduler died or was cut off) or worker (the request's worker was lost and no "
                               "other of its scheduler's took it).", (*m, "cause"), registry=registry)
        # Per API key: labelled by the key's id, never the key (ids come from the keys file: bounded).
        # Made by start_keys, so that a router without keys exports no family without samples.
        self._registry = registry
        self.key_requests: Counter | None = None
        self.key_tokens: Counter | None = None

    def start_keys(self, key_ids: list[str]) -> None:
        """Creates the per-key series at 0 for these ids (at start, and after the keys file changed)."""
        if not key_ids:
            return
        if self.key_requests is None:
            self.key_requests = Counter("kvmesh_api_key_requests", "Requests per API key id, by outcome: admitted, "
                                        "or refused by requests_per_s, tokens_per_min or max_concurrent.",
                                        ("key_id", "outcome"), registry=self._registry)
            self.key_tokens = Counter("kvmesh_api_key_tokens", "Prompt and output tokens charged to an API key id.",
                                      ("key_id",), registry=self._registry)
        for key_id in key_ids:
            for outcome in KEY_OUTCOMES:
                self.key_requests.labels(key_id, outcome)
            self.key_tokens.labels(key_id)

    def start(self, model: str) -> None:
        """Creates `model`'s series at 0 (counters, histograms and gauges), so they are scraped before any request."""
        for metric in (self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.prompt_len, self.output_len,
                       self.prompt_tokens, self.generation_tokens, self.in_flight, self.cancelled, self.prefill_time,
                       self.decode_time, self.inference_time, self.max_tokens, self.schedulers):
            metric.labels(model)
        for reason in FINISH_REASONS:
            self.success.labels(model, reason)
        for code in FAILURE_CODES:
            self.failure.labels(model, code)
        for outcome in ("hit", "miss", "unavailable"):
            self.prefix_lookups.labels(model, outcome)
        for cause in ("scheduler", "worker"):
            self.resumes.labels(model, cause)


class SchedulerMetrics:
    """Per worker batching loop; the series vLLM also has carry its `model_name` (the scheduler's pool)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY, model_name: str = "default"):
        self.model_name = model_name
        w, mw = ("worker",), ("model_name", "worker")
        self.running = Gauge("kvmesh_num_requests_running", "Requests in the worker's batch.", mw, registry=registry)
        self.waiting = Gauge("kvmesh_num_requests_waiting", "Requests queued for the worker.", mw, registry=registry)
        self.token_queue = Gauge("kvmesh_estimated_token_queue",
                                 "Prompt plus expected output tokens of waiting requests (the autoscaling signal).",
                                 w, registry=registry)
        self.preemptions = Counter("kvmesh_num_preemptions", "Requests preempted (pages taken back, recomputed later).",
                                   mw, registry=registry)
        self.prefix_queries = Counter("kvmesh_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      mw, registry=registry)
        self.prefix_hits = Counter("kvmesh_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   mw, registry=registry)
        self.prefix_waits = Counter("kvmesh_prefix_cache_waits",
                                    "Requests that waited for a running request to compute pages of their prompt "
                                    "(the same system prompt), to take them from the prefix cache instead of computing "
                                    "them again.", mw, registry=registry)
        self.orphaned_pages = Gauge("kvmesh_kv_pages_held_by_finished_requests",
                                    "KV pages held by sequences that are no longer running or waiting; must be 0.",
                                    w, registry=registry)
        self.desired_workers = Gauge("kvmesh_desired_workers",
                                     "Workers the pool should run (token queue, TTFT p95 guardrail, warm pool): for an HPA or KEDA.",
                                     ("pool",), registry=registry)
        self.drained = Counter("kvmesh_workers_drained", "Workers drained after failing health checks.",
                               ("pool",), registry=registry)
        self.step = Histogram("kvmesh_step_duration_seconds", "One batch step, scheduler to worker and back.",
                              w, buckets=STEP_BUCKETS, registry=registry)
        self.batch_size = Histogram("kvmesh_batch_size", "Sequences in one step.", w, buckets=BATCH_BUCKETS,
                                    registry=registry)
        self.step_tokens = Histogram("kvmesh_step_tokens", "Tokens in one step (decodes plus prefill chunks).",
                                     w, buckets=TOKEN_COUNT_BUCKETS, registry=registry)
        self.steps_ahead = Counter("kvmesh_steps_planned_ahead", "Steps planned and sent while the step before was "
                                   "still out (overlap_steps).", w, registry=registry)
        # Where prompt KV came from, and the page fetches that brought it (issue 16's moving pages).
        self.hits_by_source = Counter("kvmesh_prefix_cache_hits_by_source",
                                      "Prompt tokens not computed for a request, by where their KV came from: local "
                                      "(the worker's pool), peer (fetched from another worker), tier (a host-memory tier).",
                                      ("model_name", "worker", "source"), registry=registry)
        self.transfer_bytes = Counter("kvmesh_kv_transfer_bytes", "KV bytes fetched into the worker's pool, by source.",
                                      ("model_name", "worker", "source"), registry=registry)
        self.transfers = Counter("kvmesh_kv_transfers", "Page fetches, by source and outcome (ok, partial, failed, "
                                 "no_pages: none to reserve).", ("model_name", "worker", "source", "outcome"), registry=registry)
        self.drained.labels(model_name)

    def _by_source(self, worker: str):
        """(metric, label tuple) of the per-source series of one worker."""
        m = self.model_name
        for source in HIT_SOURCES:
            yield self.hits_by_source, (m, worker, source)
        for source in TRANSFER_SOURCES:
            yield self.transfer_bytes, (m, worker, source)
            for outcome in TRANSFER_OUTCOMES:
                yield self.transfers, (m, worker, source, outcome)

    def _series(self):
        """(metric, labels it takes besides the worker)"""
        with_model = (self.running, self.waiting, self.preemptions, self.prefix_queries, self.prefix_hits, self.prefix_waits)
        worker_only = (self.token_queue, self.orphaned_pages, self.step, self.batch_size, self.step_tokens, self.steps_ahead)
        return [(m, (self.model_name,)) for m in with_model] + [(m, ()) for m in worker_only]

    def worker(self, worker: str) -> "WorkerSeries":
        """A joining worker's series, created now (its counters at 0)."""
        series = WorkerSeries(*(metric.labels(*labels, worker) for metric, labels in self._series()))
        m = self.model_name
        series.hits_by_source = {s: self.hits_by_source.labels(m, worker, s) for s in HIT_SOURCES}
        series.transfer_bytes = {s: self.transfer_bytes.labels(m, worker, s) for s in TRANSFER_SOURCES}
        series.transfers = {(s, o): self.transfers.labels(m, worker, s, o) for s in TRANSFER_SOURCES for o in TRANSFER_OUTCOMES}
        return series

    def forget(self, worker: str) -> None:
        """Drops a departed worker's series, so replaced workers do not pile up."""
        for metric, labels in self._series():
            try:
                metric.remove(*labels, worker)
            except KeyError:
                pass
        for metric, labels in self._by_source(worker):
            try:
                metric.remove(*labels)
            except KeyError:
                pass


HIT_SOURCES = ("local", "peer", "tier")
TRANSFER_SOURCES = ("peer", "tier")
TRANSFER_OUTCOMES = ("ok", "partial", "failed", "no_pages")


@dataclass
class WorkerSeries:
    """One worker's series in the scheduler's metrics (in SchedulerMetrics._series order)."""

    running: Gauge
    waiting: Gauge
    preemptions: Counter
    prefix_queries: Counter
    prefix_hits: Counter
    prefix_waits: Counter
    token_queue: Gauge
    orphaned_pages: Gauge
    step: Histogram
    batch_size: Histogram
    step_tokens: Histogram
    steps_ahead: Counter
    hits_by_source: dict = field(default_factory=dict)  # source -> Counter
    transfer_bytes: dict = field(default_factory=dict)  # source -> Counter
    transfers: dict = field(default_factory=dict)  # (source, outcome) -> Counter


class KVCacheMetrics:
    """Page accounting per worker: free + used + cached == total."""

    def __init__(self, registry: CollectorRegistry = REGISTRY):
        w = ("worker",)
        # Not `_total`: that suffix is for counters (promtool).
        self.total = Gauge("kvmesh_kv_pages_capacity", "KV pages in the worker's pool.", w, registry=registry)
        self.used = Gauge("kvmesh_kv_pages_used", "KV pages held by running sequences.", w, registry=registry)
        self.free = Gauge("kvmesh_kv_pages_free", "KV pages holding nothing.", w, registry=registry)
        self.cached = Gauge("kvmesh_kv_pages_cached", "KV pages held only by the prefix cache (evictable).",
                            w, registry=registry)
        self.usage = Gauge("kvmesh_kv_cache_usage_ratio", "Used pages / total pages.", w, registry=registry)

    def set_pages(self, worker: str, total: int, used: int, free: int, cached: int) -> None:
        self.total.labels(worker).set(total)
        self.used.labels(worker).set(used)
        self.free.labels(worker).set(free)
        self.cached.labels(worker).set(cached)
        self.usage.labels(worker).set(used / total if total else 0.0)

    def forget(self, worker: str) -> None:
        for gauge in (self.total, self.used, self.free, self.cached, self.usage):
            try:
                gauge.remove(worker)
            except KeyError:
                pass


class WorkerMetrics:
    """The model runner: forward time and memory."""

    def __init__(self, worker: str, registry: CollectorRegistry = REGISTRY):
        w = ("worker",)
        self.forward = Histogram("kvmesh_forward_seconds", "One forward pass and sampling over a flattened batch.",
                                 w, buckets=STEP_BUCKETS, registry=registry).labels(worker)
        self.memory = Gauge("kvmesh_worker_memory_bytes",
                            "Worker memory: resident (process RSS) on CPU; gpu_used and gpu_total on CUDA.",
                            (*w, "kind"), registry=registry)
        self.cold_start = Gauge("kvmesh_worker_cold_start_seconds", "Process start to ready (weights loaded, warmed up).",
                                w, registry=registry).labels(worker)
        self.pages_sent = Counter("kvmesh_kv_pages_sent_total",
                                  "KV pages this worker sent to others (ReadPages), by where it read them: pool or tier.",
                                  (*w, "source"), registry=registry)
        for source in ("pool", "tier"):
            self.pages_sent.labels(worker, source)
        self.offload = Gauge("kvmesh_kv_offload_bytes",
                             "The host-memory tier of evicted KV pages (--kv-offload-mib): bytes used and capacity.",
                             (*w, "kind"), registry=registry)
        # CUDA only, read through pynvml at scrape time (kvmesh/services/worker/device.py).
        self.gpu_utilization = Gauge("kvmesh_worker_gpu_utilization_percent",
                                     "Percent of the last sample period the GPU ran a kernel (NVML).", w, registry=registry)
        self.gpu_temperature = Gauge("kvmesh_worker_gpu_temperature_celsius", "GPU core temperature (NVML).",
                                     w, registry=registry)
        self.gpu_ecc_uncorrected = Gauge("kvmesh_worker_gpu_ecc_uncorrected_errors",
                                         "Uncorrected ECC errors since the driver loaded; above 0 fails the health check.",
                                         w, registry=registry)
        self.gpu_xid = Gauge("kvmesh_worker_gpu_critical_xid",
                             "The critical XID event the device reported (0: none); any fails the health check.",
                             w, registry=registry)
        self.worker = worker


def serve_metrics(host: str, port: int) -> int | None:
    """Starts the /metrics HTTP server on its own thread; returns the bound port (None when port is -1)."""
    if port < 0:
        return None
    from prometheus_client import start_http_server

    try:
        server, _ = start_http_server(port, addr=host)
    except OSError as e:
        raise OSError(e.errno, f"cannot serve /metrics on {host}:{port} (--metrics-port): {e.strerror}") from None
    return server.server_port
