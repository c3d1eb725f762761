"""The worker's gRPC adapter: `Worker/Step` (one bidirectional stream per scheduler) and `Info`.

Startup: the server listens at once (health NOT_SERVING), loads the weights, runs a warm-up
step, then turns SERVING and registers in Redis with a fresh epoch. A new Step stream means a
new owner (a scheduler that adopted it, or a restarted one): the worker forgets every sequence
of the previous stream, whose next read fails. Owners are fenced: a stream carries its
scheduler's lease token (`kvmesh-lease-token` metadata), and a token below the highest this
worker has accepted is a scheduler that lost its lease, refused with FAILED_PRECONDITION.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import torch

from kvmesh import telemetry
from kvmesh.metrics import WorkerMetrics, serve_metrics
from kvmesh.params import SamplingParams
from kvmesh.services import wire
from kvmesh.services.config import CommonConfig, WorkerConfig
from kvmesh.services.grpc_server import ServiceServer, advertised_address, serve_until_stopped
from kvmesh.services.registry import Registry
from kvmesh.services.tls import mesh_channel, mesh_identity, mesh_server_credentials
from kvmesh.services.wire import LEASE_TOKEN_METADATA, SCHEDULER_METADATA
from kvmesh.services.worker import device
from kvmesh.services.worker.model import CausalLM
from kvmesh.services.worker.runner import KVPool, ModelRunner
from kvmesh.services.worker.team import TeamTuner
from kvmesh.step import NewSequence, ScheduledChunk, StepPlan
from kvmesh.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("kvmesh.worker")


class StepTracer:
    """Spans of the worker's steps, made after each step's result is sent: one `kvmesh.token_step`
    per sampled token of a traced sequence (a child of its request's span), `kvmesh.prefill_chunk`
    for a chunk that samples nothing yet, and one `kvmesh.forward` per step linked to those requests."""

    def __init__(self, worker_id: str):
        self.tracer = telemetry.tracer("kvmesh.worker")
        self.worker_id = worker_id
        self.seqs: dict[str, list] = {}  # seq id -> [parent context, its span context, sampled before]

    def track(self, plan: StepPlan) -> None:
        for seq_id in plan.dropped:
            self.seqs.pop(seq_id, None)
        for new in plan.new:
            self.seqs.pop(new.seq_id, None)
            if new.traceparent:
                ctx = telemetry.context_from_traceparent(new.traceparent)
                self.seqs[new.seq_id] = [ctx, telemetry.span_context_from_traceparent(new.traceparent), False]

    def record(self, step: int, plan: StepPlan, result, start_ns: int, end_ns: int) -> None:
        traced = [c for c in plan.scheduled if c.seq_id in self.seqs]
        if not traced:
            return
        sampled = {t.seq_id for t in result.tokens}
        common = {"kvmesh.step": step, "kvmesh.batch_size": len(plan.scheduled), "kvmesh.step_tokens": plan.num_tokens,
                  "kvmesh.forward_ms": result.forward_s * 1000, "kvmesh.worker_id": self.worker_id}
        for chunk in traced:
            state = self.seqs[chunk.seq_id]
            if chunk.seq_id in sampled:
                phase = "prefill" if chunk.num_tokens > 1 or not state[2] else "decode"
                state[2] = True
                name = "kvmesh.token_step"
            else:
                phase, name = "prefill", "kvmesh.prefill_chunk"
            self.tracer.start_span(name, context=state[0], start_time=start_ns,
                                   attributes={**common, "kvmesh.phase": phase, "kvmesh.chunk_tokens": chunk.num_tokens},
                                   ).end(end_time=end_ns)
        links = [telemetry.Link(self.seqs[c.seq_id][1]) for c in traced if self.seqs[c.seq_id][1] is not None]
        self.tracer.start_span("kvmesh.forward", context=telemetry.otel_context.Context(), start_time=start_ns,
                               links=links, attributes=common).end(end_time=end_ns)

    def clear(self) -> None:
        self.seqs.clear()


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """Step: StepRequest in, StepResult out, one per step, in order. A sequence the runner cannot
    take or run (a token outside the vocabulary, a page outside the pool, sampling values outside
    their limits, a row it cannot sample) fails alone, in `failed` with its reason; a step that
    still raises answers with `error` set and the stream stays open. Info: what the scheduler
    needs to plan pages and validate requests (vocab_size, max_context)."""

    def __init__(self, fault_rate: float = 0.0, fault_kill_after_pages: int = 0, identity=None,
                 fault_kill_after_fetched_pages: int = 0):
        self.runner: ModelRunner | None = None
        self.identity = identity  # mTLS to peer workers (FetchPages) when set
        self.fault_kill_after_pages = fault_kill_after_pages
        self.fault_kill_after_fetched_pages = fault_kill_after_fetched_pages
        self.pages_sent = self.pages_fetched = 0
        # Page copies for peers and fetches: off the compute thread (steps go on meanwhile) and off
        # the event loop (a page is up to megabytes).
        self._copies = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-copy")
        self.metrics: WorkerMetrics | None = None
        self.step_tracer: StepTracer | None = None
        self.memory: device.DeviceMonitor | None = None
        self.fault_rate = fault_rate
        # Every step runs on this one thread: torch's OpenMP pool belongs to the calling thread,
        # and steps hopping between executor threads would keep several pools alive and spinning.
        self._compute = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="step")
        self.team: TeamTuner | None = None  # the steps' thread count, measured (team.py; --threads 0 on a CPU)
        self.info = worker_pb2.WorkerInfo()
        self._stream_owner = 0
        self.lease_token = 0  # the highest scheduler lease token accepted (fencing)
        self.owner = ""

    async def Step(self, request_iterator, context):
        if self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is still loading its model")
        metadata = dict(context.invocation_metadata() or ())
        token_text, scheduler = metadata.get(LEASE_TOKEN_METADATA, "0"), metadata.get(SCHEDULER_METADATA, "")
        if not token_text.isdigit() or len(token_text) > 20:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{LEASE_TOKEN_METADATA}: must be a whole number, got {token_text[:32]!r}")
        if int(token_text) < self.lease_token:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"lease token {token_text} is stale: this worker is owned with token {self.lease_token} "
                                f"(by {self.owner or 'another scheduler'})")
        self.lease_token, self.owner = int(token_text), scheduler[:256]
        self._stream_owner += 1
        owner = self._stream_owner
        self.runner.seqs.clear()  # a new scheduler stream owns this worker from now on
        self.runner.store.report_whole_tier()  # its new owner learns the tier with the first result
        self.step_tracer.clear()
        async for request in request_iterator:
            if owner != self._stream_owner:
                await context.abort(grpc.StatusCode.ABORTED, "another scheduler stream took over this worker")
            plan = wire.plan_from_proto(request)
            self.step_tracer.track(plan)
            try:
                result, start_ns, end_ns = await asyncio.get_running_loop().run_in_executor(self._compute, self._step, plan)
            except Exception as e:  # one bad step must not take the worker down
                log.exception("step %d failed", request.step)
                for chunk in plan.scheduled:
                    self.runner.seqs.pop(chunk.seq_id, None)
                yield worker_pb2.StepResult(step=request.step, error=f"{type(e).__name__}: {e}")
                continue
            if self.fault_rate:
                inject_faults(result, self.fault_rate)
            if result.failed:
                log.warning("step %d: %d sequences failed alone: %s", request.step, len(result.failed),
                            "; ".join(f"{k}: {v}" for k, v in list(result.failed.items())[:4]))
            yield wire.result_to_proto(request.step, result)
            # After the result is on its way: the scheduler is busy with it meanwhile.
            self.metrics.forward.observe(result.forward_s)
            self.step_tracer.record(request.step, plan, result, start_ns, end_ns)

    def _step(self, plan: StepPlan):
        start_ns = time.time_ns()
        if (tuner := self.team) is not None and (team := tuner.team()) != torch.get_num_threads():
            torch.set_num_threads(team)  # this thread's team: every step runs here
        result = self.runner.step(plan)
        if tuner is not None:
            tuner.record(plan.num_tokens, result.forward_s)
        # Cores the tuner found the step faster without (its current team, not a trial's: the
        # scheduler's overlap follows its decisions). A thread count set by --threads says nothing
        # of the host: other workers may run on the rest of its cores (prefix_routing.py's four
        # one-thread workers on two cores lost time to first token with steps overlapped).
        result.spare_cores = tuner.cores - tuner.current if tuner is not None else 0
        return result, start_ns, time.time_ns()

    def _layout_problem(self, page_bytes: int, dtype: str) -> str | None:
        store = self.runner.store
        mine = str(self.runner.model.dtype).removeprefix("torch.")
        if page_bytes != store.page_bytes or dtype != mine:
            return (f"page layout differs: this worker's pages are {store.page_bytes} bytes of {mine}, "
                    f"the reader's {page_bytes} bytes of {dtype or 'unknown'}")
        return None

    async def ReadPages(self, request, context):
        """Streams the leading pages of `hashes` this worker holds (pool or tier), in order."""
        if self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is still loading its model")
        if (problem := self._layout_problem(request.page_bytes, request.dtype)) is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        if len(request.hashes) > self.runner.pool.num_pages:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"hashes: {len(request.hashes)}, over this worker's {self.runner.pool.num_pages} pages")
        loop = asyncio.get_running_loop()
        pages = self.runner.store.read(list(request.hashes))
        while (page := await loop.run_in_executor(self._copies, next, pages, None)) is not None:
            h, k, v, from_tier = page
            yield worker_pb2.PageData(hash=h, k=tensor_bytes(k), v=tensor_bytes(v), from_tier=from_tier)
            self.pages_sent += 1
            self.metrics.pages_sent.labels(self.metrics.worker, "tier" if from_tier else "pool").inc()
            if self.fault_kill_after_pages and self.pages_sent >= self.fault_kill_after_pages:
                fault_kill(f"{self.pages_sent} pages sent (--fault-kill-after-pages)")

    async def FetchPages(self, request, context):
        """Reads pages from a peer (or this worker's tier) into the pages its scheduler reserved."""
        if self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is still loading its model")
        token = dict(context.invocation_metadata() or ()).get(LEASE_TOKEN_METADATA, "")
        if not self.lease_token or token != str(self.lease_token):
            # Only the scheduler whose step stream owns the worker reserved these pages; a stale
            # owner's fetch would overwrite pages the new owner has handed out since.
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{LEASE_TOKEN_METADATA}: {token[:24] or 'none'} is not the lease token this worker "
                                f"is owned with ({self.lease_token}, by {self.owner or 'no scheduler yet'})")
        store, num_pages = self.runner.store, self.runner.pool.num_pages
        hashes, pages = list(request.hashes), list(request.page_ids)
        if len(hashes) != len(pages) or len(pages) > num_pages:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"hashes and page_ids: {len(hashes)} and {len(pages)}, "
                                f"must be as many, at most the pool's {num_pages}")
        if pages and max(pages) >= num_pages:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"page_ids: page {max(pages)} is outside the pool [0, {num_pages})")
        loop = asyncio.get_running_loop()
        done = nbytes = from_tier = 0
        error = ""
        dtype = str(self.runner.model.dtype).removeprefix("torch.")
        started = time.monotonic()
        channel = None
        try:
            if request.source:
                channel = mesh_channel(request.source, self.identity,
                                       options=(("grpc.max_receive_message_length", 2 * store.page_bytes + (1 << 20)),))
                call = worker_pb2_grpc.WorkerStub(channel).ReadPages(
                    worker_pb2.ReadPagesRequest(hashes=hashes, page_bytes=store.page_bytes, dtype=dtype),
                    timeout=request.timeout_s or None)
                source = _decoded(call, store)
            else:
                source = _local_pages(store, hashes, loop, self._copies)
            async for h, k, v, tiered in source:
                if done == len(pages) or h != hashes[done]:
                    error = "the source sent a page that was not asked for"
                    break
                await loop.run_in_executor(self._copies, store.write, pages[done], h, k, v)
                done += 1
                self.pages_fetched += 1
                if self.fault_kill_after_fetched_pages and self.pages_fetched >= self.fault_kill_after_fetched_pages:
                    fault_kill(f"{self.pages_fetched} fetched pages written (--fault-kill-after-fetched-pages)")
                nbytes += store.page_bytes
                from_tier += tiered
        except grpc.aio.AioRpcError as e:
            error = f"{request.source}: {e.code().name}: {e.details()}"
        except ValueError as e:
            error = str(e)
        finally:
            if channel is not None:
                await channel.close()
        if done < len(pages) and not error:
            error = f"the source holds only {done} of the {len(pages)} pages"
        (log.warning if error else log.debug)(
            "fetched %d/%d pages (%d bytes, %d from a tier) from %s in %.3fs%s", done, len(pages), nbytes, from_tier,
            request.source or "this worker's tier", time.monotonic() - started, f": {error}" if error else "")
        return worker_pb2.FetchPagesResponse(pages=done, bytes=nbytes, from_tier=from_tier, error=error)

    async def Info(self, request, context):
        """What the scheduler plans with, and the health facts it checks (memory, the check prompt)."""
        if self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is still loading its model")
        info = worker_pb2.WorkerInfo()
        info.CopyFrom(self.info)
        info.lease_token, info.owner = self.lease_token, self.owner
        info.memory_used_bytes, info.memory_total_bytes = self.memory.read()
        info.device_error = self.memory.error()
        return info


async def _local_pages(store, hashes: list[bytes], loop, executor):
    """This worker's own pages (its tier, or its pool): (hash, k, v, from_tier), no wire format."""
    pages = store.read(hashes)
    while (page := await loop.run_in_executor(executor, next, pages, None)) is not None:
        yield page


async def _decoded(call, store):
    """A peer's ReadPages stream as (hash, k, v, from_tier); ValueError for a page of the wrong size."""
    async for data in call:
        yield data.hash, page_from_bytes(data.k, store), page_from_bytes(data.v, store), data.from_tier


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def page_from_bytes(data: bytes, store) -> torch.Tensor:
    """One page's K or V from the wire; ValueError when its size is not this pool's page."""
    if len(data) * 2 != store.page_bytes:
        raise ValueError(f"a page of {len(data)} bytes, this pool's K or V page is {store.page_bytes // 2}")
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(store.k.dtype)
    return flat.view(store.page_shape())


def fault_kill(why: str) -> None:
    """TESTING ONLY flags: this worker dies at once, as a crash would take it."""
    log.error("killing this worker after %s", why)
    os.kill(os.getpid(), signal.SIGKILL)


def is_faulty(seq_id: str, rate: float) -> bool:
    """Fault injection for tests: the same requests fail on every run (a hash of the id, not chance)."""
    h = int.from_bytes(hashlib.blake2b(seq_id.encode(), digest_size=8, person=b"kvmesh-fault").digest(), "big")
    return h < rate * 2**64


def inject_faults(result, rate: float) -> None:
    """Turns the first token of each faulty sequence into a failure of that sequence alone."""
    for token in [t for t in result.tokens if is_faulty(t.seq_id, rate)]:
        result.tokens.remove(token)
        result.failed[token.seq_id] = "injected fault (--fault-rate)"


CPU_KV_MIB = 1024  # the KV pool on the CPU when --kv-memory-mib is not given


def load_runner(cfg: WorkerConfig) -> ModelRunner:
    """The model on its device and its KV pool: `--kv-memory-mib` when given (1 GiB on the CPU
    otherwise), on CUDA what `--gpu-memory-utilization` leaves after the weights and a profiled
    step of `--max-step-tokens`."""
    from kvmesh.modelgen import default_model_dir

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    started = time.monotonic()
    dev = device.resolve_device(cfg.device)
    free_at_start = total = 0
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        free_at_start, total = torch.cuda.mem_get_info(dev)
        device.kv_cache_bytes(total, free_at_start, free_at_start, 0, cfg.gpu_memory_utilization)  # the budget fits at all
    model = CausalLM.load(cfg.model or default_model_dir(), device.default_dtype(dev, cfg.dtype), dev)
    loaded = time.monotonic()
    if cfg.kv_memory_mib or dev.type != "cuda":
        kv_bytes = (cfg.kv_memory_mib or CPU_KV_MIB) << 20
        plan = device.MemoryPlan(model.weight_bytes(), 0, kv_bytes)
    else:
        plan = profile_memory(model, cfg, free_at_start, total)
    num_pages = KVPool.pages_for_budget(model, plan.kv_cache, cfg.page_size)
    try:
        runner = ModelRunner(model, num_pages, cfg.page_size, cfg.kv_offload_mib << 20)
    except torch.cuda.OutOfMemoryError as e:
        raise device.DeviceError(f"kv_memory_mib: {plan.kv_cache >> 20} MiB of KV cache do not fit on {dev} "
                                 f"beside the weights ({e}): lower it, or leave it 0 for --gpu-memory-utilization") from None
    allocated = time.monotonic()
    warm_up(runner)
    if runner.max_context < model.cfg.max_position_embeddings:
        log.warning("the KV pool (%d pages of %d tokens) holds fewer tokens than the model's context of %d: "
                    "requests are limited to %d tokens (raise --kv-memory-mib%s for more)", num_pages, cfg.page_size,
                    model.cfg.max_position_embeddings, runner.max_context,
                    " or --gpu-memory-utilization" if dev.type == "cuda" else "")
    log.info("model on %s in %s: %s; %d KV pages of %d tokens", dev, str(model.dtype).removeprefix("torch."),
             plan.describe(), num_pages, cfg.page_size)
    log.info("start-up: weights %.1fs, KV pool %.1fs, warm-up %.1fs", loaded - started, allocated - loaded,
             time.monotonic() - allocated)
    if dev.type == "cpu":
        threading.Thread(target=populate_pool, args=(runner.pool,), name="kv-populate", daemon=True).start()
    return runner


def populate_pool(pool: KVPool) -> None:
    """Backs the CPU KV pool with memory behind the worker's back (`KVPool.populate`), on a thread of
    the lowest priority, so that serving neither waits for it at start nor pays for it in steps."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only, on Linux
    except (OSError, AttributeError):
        pass
    started = time.monotonic()
    if (why := pool.populate()) is None:
        log.info("KV pool backed with memory in %.1fs", time.monotonic() - started)
    else:
        log.warning("KV pool not backed with memory in full: %s", why)


PROFILE_SEQS = 256  # the sampled rows of the profiled step: each one's logits are a vocabulary of float32


def profile_memory(model: CausalLM, cfg: WorkerConfig, free_at_start: int, total: int) -> device.MemoryPlan:
    """Runs one step of `--max-step-tokens` prompt tokens spread over up to PROFILE_SEQS sequences
    (the largest step the worker expects, with that many rows of logits), over a KV pool just large
    enough; measures the activations' peak above the weights, frees it all, and sizes the KV
    cache from what the budget leaves (`device.kv_cache_bytes`)."""
    tokens = min(cfg.max_step_tokens, model.cfg.max_position_embeddings * PROFILE_SEQS)
    seqs = max(1, min(PROFILE_SEQS, tokens // 32))
    per_seq = min(tokens // seqs, model.cfg.max_position_embeddings)
    pages_per_seq = -(-per_seq // cfg.page_size)
    probe = ModelRunner(model, seqs * pages_per_seq, cfg.page_size)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    greedy = SamplingParams(temperature=0.0)
    new = [NewSequence(f"memory-profile-{i}", [(7 * (i + j) + 3) % model.cfg.vocab_size for j in range(per_seq)],
                       per_seq, greedy, list(range(i * pages_per_seq, (i + 1) * pages_per_seq))) for i in range(seqs)]
    probe.step(StepPlan(new=new, scheduled=[ScheduledChunk(n.seq_id, per_seq) for n in new]))
    torch.cuda.synchronize()
    activations = torch.cuda.max_memory_allocated() - before
    del probe
    torch.cuda.empty_cache()
    free_after, _ = torch.cuda.mem_get_info()
    kv = device.kv_cache_bytes(total, free_at_start, free_after, activations, cfg.gpu_memory_utilization)
    return device.MemoryPlan(model.weight_bytes(), activations, kv)


def warm_up(runner: ModelRunner) -> None:
    """Real steps (two sequences prefilled, then two decode steps) so the first requests pay no
    first-call costs: oneDNN primitives for prefill and decode shapes, the decode kernel's threads.
    Without the decode steps a fresh worker's first decodes were slow enough to fail a canary's
    latency comparison against a warm stable worker."""
    ids = ("warm-up-0", "warm-up-1")
    per_seq = -(-6 // runner.page_size)  # 3 prompt tokens, 3 sampled
    runner.step(StepPlan(new=[NewSequence(s, [1, 2, 3], 3, SamplingParams(temperature=0.0),
                                          list(range(i * per_seq, (i + 1) * per_seq))) for i, s in enumerate(ids)],
                         scheduled=[ScheduledChunk(s, 3) for s in ids]))
    for _ in range(2):
        runner.step(StepPlan(scheduled=[ScheduledChunk(s, 1) for s in ids]))
    runner.seqs.clear()


CHECK_TOKENS = 6


def check_prompt(vocab_size: int) -> list[int]:
    """The inference health check's canned prompt (token ids valid for any vocabulary)."""
    return [(37 * i + 11) % vocab_size for i in range(10)]


def greedy_answer(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    """The check's known answer: `n` greedy tokens, computed once at start-up when the worker is known good."""
    pages = list(range(runner.pool.num_pages))[: -(-(len(prompt) + n) // runner.page_size)]
    plan = StepPlan(new=[NewSequence("health-check", prompt, len(prompt), SamplingParams(temperature=0.0), pages)],
                    scheduled=[ScheduledChunk("health-check", len(prompt))])
    answer = []
    for _ in range(n):
        answer.append(runner.step(plan).tokens[0].token_id)
        plan = StepPlan(scheduled=[ScheduledChunk("health-check", 1)])
    runner.seqs.clear()
    return answer


async def watch_drain(registry: Registry, worker_id: str, server) -> None:
    """When the scheduler drains this worker (failed health checks), turn NOT_SERVING (readiness fails)
    and stop, so that the orchestrator starts a fresh process."""
    while True:
        await asyncio.sleep(2.0)
        try:
            reason = await registry.drained(worker_id)
        except Exception:
            continue
        if reason:
            log.error("drained by the scheduler (%s): stopping so that a fresh process replaces this one", reason)
            await server.set_serving(False)
            os.kill(os.getpid(), signal.SIGTERM)
            return


async def serve(common: CommonConfig, cfg: WorkerConfig) -> None:
    import psutil

    dev = device.resolve_device(cfg.device)  # before anything starts: a device it lacks is a setting error
    telemetry.setup_tracing("worker")
    metrics_port = serve_metrics(common.host, cfg.metrics_port)
    service = WorkerService(cfg.fault_rate, cfg.fault_kill_after_pages, mesh_identity(common),
                            cfg.fault_kill_after_fetched_pages)
    server = ServiceServer(["kvmesh.v1.Worker"], lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(service, s),
                           common.host, cfg.port, mesh_server_credentials(common))
    await server.start()
    address = advertised_address(common, server.port)
    worker_id = cfg.worker_id or address
    service.metrics = WorkerMetrics(worker_id)
    service.step_tracer = StepTracer(worker_id)
    service.memory = device.DeviceMonitor(dev)
    service.memory.export(service.metrics)
    log.info("worker %s listening on %s, loading model", worker_id, address)
    registry = Registry(common.redis_url)
    await registry.clear_drained(worker_id)  # a fresh process: whatever drained the last one is gone with it
    service.runner = runner = await asyncio.get_running_loop().run_in_executor(service._compute, load_runner, cfg)
    cores = await asyncio.get_running_loop().run_in_executor(service._compute, torch.get_num_threads)  # the steps' thread's
    if not cfg.threads and runner.model.device.type == "cpu" and cores >= 2:
        service.team = TeamTuner(cores)
    service.metrics.offload.labels(worker_id, "used").set_function(lambda: runner.store.tier_bytes)
    service.metrics.offload.labels(worker_id, "capacity").set(runner.store.tier_capacity * runner.store.page_bytes)
    epoch = await registry.next_epoch(worker_id)
    model_dir = Path(cfg.model) if cfg.model else None
    mcfg = runner.model.cfg
    prompt = check_prompt(mcfg.vocab_size)
    answer = await asyncio.get_running_loop().run_in_executor(service._compute, greedy_answer, runner, prompt, CHECK_TOKENS)
    service.info = worker_pb2.WorkerInfo(
        worker_id=worker_id, model=str(model_dir or "default"), num_pages=runner.pool.num_pages, page_size=runner.page_size,
        max_context=runner.max_context, vocab_size=mcfg.vocab_size, eos_token_ids=list(mcfg.eos_token_ids),
        epoch=epoch, pool=cfg.pool, version=cfg.version, check_prompt=prompt, check_answer=answer,
        device=str(runner.model.device), dtype=str(runner.model.dtype).removeprefix("torch."),
        page_bytes=runner.store.page_bytes, offload_bytes=runner.store.tier_capacity * runner.store.page_bytes,
        step_tokens=device.default_step_tokens(runner.model.device, runner.model.dtype))
    cold_start = time.time() - psutil.Process().create_time()
    service.metrics.cold_start.set(cold_start)
    print(f"worker {worker_id} ready on {address} ({runner.pool.num_pages} KV pages, epoch {epoch}, "
          f"cold start {cold_start:.1f}s)", flush=True)
    metrics_address = advertised_address(common, metrics_port) if metrics_port else ""
    registry.on_restore.append(lambda: registry.keep_epoch(worker_id, epoch))
    watcher = asyncio.create_task(watch_drain(registry, worker_id, server))
    await serve_until_stopped(server, registry, "worker", worker_id, tasks=(watcher,), record=
                              {"address": address, "epoch": epoch, "num_pages": runner.pool.num_pages, "page_size": runner.page_size,
                               "metrics": metrics_address, "pool": cfg.pool, "version": cfg.version,
                               "model": str(model_dir or "")})
