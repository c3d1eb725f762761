"""The scheduler's gRPC adapter: `Scheduler/Submit`, worker discovery, and the pool's duties.

Each worker of the pool found in the registry gets a `WorkerLoop` (worker_loop.py): continuous
batching over one `Worker/Step` stream. Submit places a request on a worker (prefix overlap
against load) and relays its tokens. A worker that dies or is drained hands its requests to
other workers, where they are recomputed from the tokens already streamed, so streams continue
exactly; only requests no worker can take end with an ERROR finish. Queue state, the autoscaling
signal, health checks and the rollout controller run beside it (fleet.py).

A pool may have several schedulers: each drives only the workers whose lease it holds
(ownership.py), adopts workers left free by a dead one, and one of them, the pool's leader (a
leader lease), runs the duties that must run once per pool: the rollout controller and the
autoscaling signal. Without Redis it goes on serving with the workers it has.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
import grpc

from kvmesh import telemetry
from kvmesh.fleet.health import AdmissionRamp
from kvmesh.metrics import SchedulerMetrics, serve_metrics
from kvmesh.params import InvalidRequest, validate_request, validate_request_id
from kvmesh.services import wire
from kvmesh.services.config import CommonConfig, SchedulerServiceConfig
from kvmesh.services.grpc_server import ServiceServer, advertised_address, serve_until_stopped
from kvmesh.services.kvcache.pages import prefix_hashes
from kvmesh.services.registry import Registry, pool_of, queue_state_key
from kvmesh.services.scheduler.ownership import WorkerLeases, may_adopt
from kvmesh.services.scheduler.core import TokenEvent
from kvmesh.services.scheduler.fleet import AutoscaleSignal, HealthChecks, Outcomes, PoolLeader, RolloutController
from kvmesh.services.scheduler.overload import MIN_RETRY_S, estimated_wait_s, overload_retry_s
from kvmesh.services.scheduler.placement import PlacementConfig, choose_worker
from kvmesh.services.scheduler.request import FinishReason, Request, Status
from kvmesh.services.scheduler.worker_loop import LogprobsTokenEvent, WorkerLoop
from kvmesh.services.tls import MeshIdentity, RegisteredPeers, mesh_channel, mesh_identity, mesh_server_credentials
from kvmesh.v1 import generation_pb2 as gen
from kvmesh.v1 import kvcache_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger("kvmesh.scheduler")

_REASONS = {r: gen.FinishReason.Value(r.name) for r in FinishReason}
NO_WORKER_WAIT_S = 3.0
MAX_VERSION_CHARS = 128


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    """Submit: token ids in, a stream of TokenEvents out, the last with its finish reason. It
    trusts no caller: the request is checked by the router's rules (kvmesh.params) against the
    model of the pool's workers (token ids within its vocabulary, prompt plus max_new_tokens
    within its context, sampling values within their limits), and request_id and version are
    bounded. Errors: INVALID_ARGUMENT naming the field and the limit (also when the request cannot
    fit a worker's KV pool), UNAVAILABLE when no worker is ready, RESOURCE_EXHAUSTED with a
    `retry-after` hint when the pool is overloaded: the queue is full, the chosen worker could not
    start the request within max_queue_wait_s (overload.py), or it waited that long all the same
    without starting (then nothing was streamed). Load alone never ends a request with ERROR."""

    def __init__(self, cfg: SchedulerServiceConfig, registry: Registry, metrics: SchedulerMetrics | None = None,
                 identity: MeshIdentity | None = None):
        self.cfg = cfg
        self.registry = registry
        self.scheduler_id = ""  # its registry id (the advertised address, known once bound): holds its leases
        self.leases = WorkerLeases(registry, "", cfg.worker_lease_s)
        self.leader = PoolLeader(registry, cfg.pool, "")
        self._free_since: dict[str, float] = {}  # worker id -> when it was first seen without an owner
        self.identity = identity  # mTLS to workers and kvcache when set
        self.kvcaches = RegisteredPeers(identity, "kvcache")
        self.metrics = metrics or SchedulerMetrics(model_name=cfg.pool)
        self.tracer = telemetry.tracer("kvmesh.scheduler")
        self.workers: dict[str, WorkerLoop] = {}
        self.placement = PlacementConfig(cfg.worker_choice, cfg.prefill_weight, cfg.load_weight,
                                         cfg.balance_ratio, cfg.balance_slack_pages)
        self._round_robin = itertools.count()
        self._kvcache_stub = None
        self.active_ids: set[str] = set()  # request ids with a live stream, across all workers
        self.owner: dict[str, WorkerLoop] = {}  # request id -> the worker loop running it now
        self.outcomes = Outcomes()  # finished requests per version: rollouts and autoscaling read them
        self.health = HealthChecks(self)
        self.autoscale = AutoscaleSignal(self)
        self._ramp_new_workers = False  # set once workers are known: later ones ramp up their admissions

    def kvcache(self):
        return self._kvcache_stub

    def identify(self, scheduler_id: str) -> None:
        """Its registry id, before any task runs: the holder named in its worker and leader leases."""
        self.scheduler_id = self.leases.holder = self.leader.holder = scheduler_id

    def pick_worker(self, hashes: list[bytes], version: str = "", exclude: WorkerLoop | None = None) -> WorkerLoop | None:
        """A worker for a prompt with these page hashes, of `version` ("" any), not draining."""
        alive = sorted((w for w in self.workers.values() if w.alive and not w.draining and w is not exclude
                        and (not version or w.version == version)), key=lambda w: w.worker_id)
        if not alive:
            return None
        if self.placement.policy == "round-robin":
            return alive[next(self._round_robin) % len(alive)]
        chosen = choose_worker(len(hashes), [w.view(hashes) for w in alive], self.placement)
        return self.workers[chosen.worker_id]

    def waiting_count(self) -> int:
        return sum(len(w.core.waiting) for w in self.workers.values() if w.alive)

    def retry_hint_s(self) -> float:
        """About how long the pool's queue takes to drain: its tokens over the serving workers' recent throughput."""
        serving = [w for w in self.workers.values() if w.alive and not w.draining]
        tokens = sum(w.estimated_tokens(r) for w in serving for r in w.core.waiting)
        rates = [w.throughput.tokens_per_s for w in serving]
        return max(MIN_RETRY_S, estimated_wait_s(tokens, sum(r for r in rates if r)))

    async def _refuse_for_load(self, context, span, message: str, retry_s: float):
        context.set_trailing_metadata(wire.retry_hint(retry_s))
        await self._abort(context, span, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{message}; retry in about {retry_s:.0f} s")

    async def Submit(self, request, context):
        span = self.tracer.start_span("kvmesh.schedule", kind=telemetry.SpanKind.SERVER,
                                      context=telemetry.context_from_metadata(context.invocation_metadata()))
        events = self._submit(request, context, span)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()  # at once: a client that left frees its request now, not at garbage collection
            span.end()

    async def _abort(self, context, span, code: grpc.StatusCode, message: str):
        span.set_status(telemetry.Status(telemetry.StatusCode.ERROR, f"{code.name}: {message}"))
        await context.abort(code, message)

    async def _submit(self, request, context, span):
        if (waiting := self.waiting_count()) >= self.cfg.max_queue_len:
            await self._refuse_for_load(context, span, f"queue is full ({waiting} waiting, limit "
                                        f"max_queue_len={self.cfg.max_queue_len})", self.retry_hint_s())
        if len(request.version) > MAX_VERSION_CHARS:  # before it is echoed in an UNAVAILABLE message
            await self._abort(context, span, grpc.StatusCode.INVALID_ARGUMENT,
                              f"version: has {len(request.version)} characters, over the limit of {MAX_VERSION_CHARS}")
        ready = self.ready_worker(request.version)
        for _ in range(int(NO_WORKER_WAIT_S / 0.1)):  # a worker may be (re)joining: wait, bounded
            if ready is not None:
                break
            await asyncio.sleep(0.1)
            ready = self.ready_worker(request.version)
        if ready is None:
            await self._no_worker(request, context, span)
        try:
            req = self._request(request, ready.info, span)
        except InvalidRequest as e:
            await self._abort(context, span, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        hashes = self.page_hashes(req.prompt_token_ids)
        worker = self.pick_worker(hashes, request.version)
        if worker is None:  # the one found above left meanwhile
            await self._no_worker(request, context, span)
        wait_s = worker.estimated_wait_s()
        if (retry_s := overload_retry_s(wait_s, self.cfg.max_queue_wait_s)) is not None:
            await self._refuse_for_load(context, span, f"overloaded: a request queued now would wait about {wait_s:.0f} s "
                                        f"to start, over what max_queue_wait_s={self.cfg.max_queue_wait_s:g} allows", retry_s)
        req.eos_token_ids = tuple(worker.info.eos_token_ids)
        if req.request_id in self.active_ids:
            await self._abort(context, span, grpc.StatusCode.INVALID_ARGUMENT, f"request_id {req.request_id!r} is already in use")
        expected_pages = worker.view(hashes).prefix_pages
        try:
            queue = worker.submit(req, hashes, expected_pages)
        except (InvalidRequest, ValueError) as e:
            await self._abort(context, span, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        span.set_attributes({"kvmesh.request_id": req.request_id, "kvmesh.worker_id": worker.worker_id,
                             "kvmesh.expected_prefix_pages": expected_pages})
        self.active_ids.add(req.request_id)
        self.owner[req.request_id] = worker
        finished, queue_span_done = False, False
        try:
            while not finished:
                event: TokenEvent = await queue.get()
                finished = event.finish_reason is not None
                if event.refused:  # never started: the client may retry elsewhere or later
                    await self._refuse_for_load(context, span, event.message, self.retry_hint_s())
                if not queue_span_done and (req.first_scheduled_time is not None or finished):
                    queue_span_done = self._record_queue_span(req, span)
                yield _event_to_proto(event, self.owner.get(req.request_id, worker))
            self.outcomes.record(self.owner.get(req.request_id, worker).version, req)
            reason = req.finish_reason.value if req.finish_reason else "cancelled"
            span.set_attributes({"kvmesh.finish_reason": reason, "kvmesh.preemptions": req.num_preemptions,
                                 "kvmesh.cached_prompt_tokens": req.num_cached_prompt_tokens})
            if req.finish_reason is FinishReason.ERROR:
                span.set_status(telemetry.Status(telemetry.StatusCode.ERROR, event.message))
        finally:
            self.active_ids.discard(req.request_id)
            owner = self.owner.pop(req.request_id, worker)
            owner.done(req.request_id, hashes, finished)  # cancels it if the client left or timed out

    def ready_worker(self, version: str) -> WorkerLoop | None:
        """Some worker of `version` ("" any) that takes requests: its model's limits apply to the request."""
        return next((w for w in self.workers.values() if w.alive and not w.draining
                     and (not version or w.version == version)), None)

    async def _no_worker(self, request, context, span):
        which = f"of version {request.version!r} " if request.version else ""
        await self._abort(context, span, grpc.StatusCode.UNAVAILABLE,
                          f"no worker {which}in pool {self.cfg.pool!r} is ready (waited {NO_WORKER_WAIT_S:.0f}s)")

    @staticmethod
    def _request(request, model: worker_pb2.WorkerInfo, span) -> Request:
        """The Request of a Submit, checked by the router's rules against `model` (a worker's
        info: vocab_size, max_context). Raises InvalidRequest naming the field and the limit."""
        validate_request_id(request.request_id)
        req = Request(
            request_id=request.request_id or uuid.uuid4().hex,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling=wire.sampling_from_proto(request.sampling),
            stopping=wire.stopping_from_proto(request.stopping),
            priority=request.priority,
            traceparent=telemetry.traceparent(span),
        )
        validate_request(req.prompt_token_ids, req.sampling, req.stopping, max_context=model.max_context,
                         vocab_size=model.vocab_size)
        return req

    def page_hashes(self, token_ids: list[int]) -> list[bytes]:
        page_size = next((w.pool.page_size for w in self.workers.values()), 16)
        return prefix_hashes(token_ids, page_size) if self.cfg.prefix_caching else []

    def move_requests(self, loop: WorkerLoop, reason: str) -> int:
        """Moves every request of a drained worker to others of its version (recomputed there from
        the tokens already streamed, so each stream continues exactly); ends those no worker can take."""
        moved = 0
        for req, queue in loop.take_all():
            hashes = self.page_hashes(req.prompt_token_ids)
            target = self.pick_worker(hashes, loop.version, exclude=loop)
            try:
                if req.request_id in loop.health_checks:
                    raise ValueError("a health check belongs to its worker")
                if target is None:
                    raise ValueError(f"no other worker of version {loop.version!r} is ready")
                target.submit(req, hashes, target.view(hashes).prefix_pages, queue=queue)
                self.owner[req.request_id] = target
                moved += 1
            except (InvalidRequest, ValueError) as e:
                req.status, req.finish_reason = Status.FINISHED, FinishReason.ERROR
                queue.put_nowait(TokenEvent(req, None, None, FinishReason.ERROR,
                                            f"worker {loop.worker_id} left ({reason}); {e}"))
        if moved:
            log.warning("worker %s left (%s): %d requests continue on other workers", loop.worker_id, reason, moved)
        return moved

    def _record_queue_span(self, req: Request, parent) -> bool:
        """`kvmesh.queue`: arrival to first admission (or to the end, for a request never admitted)."""
        if not telemetry.traceparent(parent):
            return True
        end = req.first_scheduled_time or time.monotonic()
        self.tracer.start_span("kvmesh.queue", context=telemetry.trace.set_span_in_context(parent),
                               start_time=_wall_ns(req.arrival_time), attributes={"kvmesh.priority": req.priority},
                               ).end(end_time=_wall_ns(end))
        return True

    async def discover(self) -> None:
        """Keeps `workers` in step with the registry: the workers this scheduler owns or adopts
        get a loop. Without Redis the loops it has go on; rounds retry with backoff."""
        while True:
            delay = 0.5
            try:
                await self.registry.check_registration()
                await self._refresh()
            except Exception as e:  # Redis down (or a bug): serve with what we have, try again
                delay = self.registry.outage.failed("worker discovery", e)
            await asyncio.sleep(delay)

    def lost_worker(self, worker_id: str) -> None:
        """Another scheduler took the worker's lease: stop driving it (its requests move to our other workers)."""
        loop = self.workers.get(worker_id)
        if loop is not None and loop.alive:
            loop.stop()

    async def _adoptable(self, records: list[dict]) -> dict[str, tuple[str, int] | None]:
        """Worker id -> its lease (None: free) for the pool's workers this scheduler may take now:
        its own, and free ones `may_adopt` allows. None is never adopted until the registry has
        settled after an outage (their owners may not have taken their leases again yet)."""
        owners = await self.registry.worker_owners([r["id"] for r in records])
        schedulers = [r for r in await self.registry.services("scheduler") if pool_of(r) == self.cfg.pool]
        now, settled = time.monotonic(), self.registry.settled()
        for worker_id in [w for w in self._free_since if w in owners or w not in {r["id"] for r in records}]:
            del self._free_since[worker_id]
        grace = self.cfg.worker_lease_s / 2
        owned = len(self.leases.tokens)
        takeable = {}
        for record in records:
            lease = owners.get(record["id"])
            if lease is None:
                free_for = now - self._free_since.setdefault(record["id"], now)
                if settled and may_adopt(owned, len(records), len(schedulers), free_for, grace):
                    takeable[record["id"]] = None
                    owned += 1
            elif lease[0] == self.scheduler_id:
                takeable[record["id"]] = lease
        return takeable

    async def _refresh(self) -> None:
        kv = await self.registry.services("kvcache")
        if kv and self._kvcache_stub is None:
            verified = await self.kvcaches.channels([r["address"] for r in kv])  # a rogue entry is skipped
            if verified:
                self._kvcache_stub = kvcache_pb2_grpc.KVCacheStub(verified[0][1])
        records = [r for r in await self.registry.services("worker") if pool_of(r) == self.cfg.pool]
        takeable = await self._adoptable(records)
        for record in records:
            current = self.workers.get(record["id"])
            if current is not None and current.info.epoch == record["epoch"] and (current.alive or current.draining):
                continue  # known; a drained worker stays drained until it restarts (a new epoch)
            if record["id"] not in takeable:
                continue  # another scheduler's
            channel = mesh_channel(record["address"], self.identity)
            try:  # with mTLS, a worker without a certificate from the CA fails here and gets no loop
                info = await worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=5)
            except grpc.aio.AioRpcError:
                await channel.close()
                continue
            token = await self.leases.claim(record["id"], takeable[record["id"]], floor=info.lease_token)
            if not token:  # another scheduler was quicker
                await channel.close()
                continue
            if current is not None and current.alive:
                current.alive = False  # restarted under the same id: the old loop's stream will break
            self.health.forget(record["id"])
            if info.owner and info.owner != self.scheduler_id:
                log.warning("adopting worker %s from scheduler %s (lease token %d)", record["id"], info.owner, token)
            loop = WorkerLoop(record, info, self.cfg, self.kvcache, self.metrics, on_gone=self.move_requests,
                              owner=self.scheduler_id, lease_token=token)
            if self._ramp_new_workers and self.cfg.admission_ramp_s:
                loop.ramp = AdmissionRamp(time.monotonic(), self.cfg.max_num_seqs, self.cfg.admission_ramp_s)
            self.workers[record["id"]] = loop
            loop.task = asyncio.create_task(loop.run(channel))
            log.info("scheduling on worker %s (%s %s) at %s", loop.worker_id, self.cfg.pool, loop.version, loop.address)
        self._ramp_new_workers = self._ramp_new_workers or bool(self.workers)  # the first ones start at full speed
        registered = {r["id"] for r in records}
        for worker_id, loop in list(self.workers.items()):
            gone = worker_id not in registered or not self.leases.holds(worker_id)  # left, or another's now
            if not loop.alive and gone and loop.task and loop.task.done():
                del self.workers[worker_id]  # forget its loop and its metric series
                self.metrics.forget(worker_id)
                self.health.forget(worker_id)
        if self.registry.settled():
            for worker_id in [w for w in self.leases.tokens if w not in registered]:
                self.leases.forget(worker_id)  # gone for good: let its lease expire

    async def publish_queue_state(self) -> None:
        """Every half second, off the batching loop: ends requests waiting past max_queue_wait_s,
        and writes the queue state to Redis: queue depth and estimated token queue of its
        workers, and per worker the waiting requests with their estimated tokens (prompt still to
        compute plus output still to come), the running ones, and step timing. The pool's leader
        adds the autoscaling signal, from the whole pool's queue. Without Redis: retries with backoff."""
        key = queue_state_key(self.scheduler_id)
        while True:
            delay = 0.5
            state = self._queue_state()
            try:
                if self.leader.held:
                    state["autoscale"] = self.autoscale.update(*await self._pool_queue(state))
                await self.registry.redis.set(key, json.dumps(state), px=3000)
            except Exception as e:  # Redis down, or a bug: the next round tries again
                delay = self.registry.outage.failed("publishing the queue state", e)
            await asyncio.sleep(delay)

    async def _pool_queue(self, own: dict) -> tuple[int, int]:
        """(estimated queued tokens, live workers) of the whole pool: ours and the other schedulers'."""
        states = [own, *(s for s in await self.registry.queue_states()
                         if pool_of(s) == self.cfg.pool and s.get("scheduler") != self.scheduler_id)]
        return (sum(s["estimated_tokens"] for s in states),
                sum(w["alive"] for s in states for w in s["workers"].values()))

    def _queue_state(self) -> dict:
        workers = {}
        for w in self.workers.values():
            if self.cfg.max_queue_wait_s and w.alive:
                w.dispatch_expired(self.cfg.max_queue_wait_s)
            waiting = [{"id": r.request_id, "priority": r.priority, "estimated_tokens": w.estimated_tokens(r)}
                       for r in w.core.waiting]
            w.publish_metrics(sum(r["estimated_tokens"] for r in waiting))
            workers[w.worker_id] = {
                "alive": w.alive and not w.draining,
                "version": w.version,
                "waiting": waiting,
                "running": [r.request_id for r in w.core.running],
                "estimated_tokens": sum(r["estimated_tokens"] for r in waiting),
                "step_timing": w.timing,
            }
        return {
            "pool": self.cfg.pool,
            "scheduler": self.scheduler_id,
            "leader": self.leader.held,
            "waiting": sum(len(w["waiting"]) for w in workers.values()),
            "running": sum(len(w["running"]) for w in workers.values()),
            "estimated_tokens": sum(w["estimated_tokens"] for w in workers.values()),
            "workers": workers,
        }


def _wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as epoch nanoseconds (span timestamps are wall-clock)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def _event_to_proto(event: TokenEvent, worker: WorkerLoop) -> scheduler_pb2.TokenEvent:
    m = scheduler_pb2.TokenEvent(worker_id=worker.worker_id, version=worker.version)
    if event.token_id is not None:
        m.token_ids.append(event.token_id)
        m.logprobs.append(event.logprob)
    if isinstance(event, LogprobsTokenEvent):
        m.top_ids.extend(event.sampled.top_ids)
        m.top_logprobs.extend(event.sampled.top_logprobs)
        if event.sampled.prompt is not None:
            m.prompt.CopyFrom(wire.prompt_logprobs_to_proto(event.sampled.prompt))
    if event.finish_reason is not None:
        req = event.request
        m.finish_reason = _REASONS[event.finish_reason]
        m.cached_prompt_tokens = req.num_cached_prompt_tokens
        m.preemptions = req.num_preemptions
        started = req.first_scheduled_time or req.finish_time or time.monotonic()
        m.queue_ms = (started - req.arrival_time) * 1000
        m.message = event.message
    return m


async def serve(common: CommonConfig, cfg: SchedulerServiceConfig) -> None:
    telemetry.setup_tracing("scheduler")
    metrics_port = serve_metrics(common.host, cfg.metrics_port)
    registry = Registry(common.redis_url)
    service = SchedulerService(cfg, registry, identity=mesh_identity(common))
    server = ServiceServer(["kvmesh.v1.Scheduler"], lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(service, s),
                           common.host, cfg.port, mesh_server_credentials(common))
    await server.start()
    address = advertised_address(common, server.port)
    service.identify(address)
    registry.on_close.append(service.leases.release_all)  # a clean stop hands its workers over at once
    tasks = [asyncio.create_task(service.discover()), asyncio.create_task(service.publish_queue_state()),
             asyncio.create_task(service.leases.keep(service.lost_worker)), asyncio.create_task(service.leader.run()),
             asyncio.create_task(RolloutController(service).run())]
    if cfg.health_check_interval_s:
        tasks.append(asyncio.create_task(service.health.run()))
    print(f"scheduler for pool {cfg.pool!r} ready on {address}", flush=True)
    record = {"address": address, "pool": cfg.pool,
              "metrics": advertised_address(common, metrics_port) if metrics_port else ""}
    await serve_until_stopped(server, registry, "scheduler", address, record, tasks=tuple(tasks))
