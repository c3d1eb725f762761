"""The scheduler's gRPC adapter: `Scheduler/Submit`, worker discovery, and the pool's duties.

Each worker of the pool found in the registry gets a `WorkerLoop` (worker_loop.py): continuous
batching over one `Worker/Step` stream. Submit places a request on a worker (prefix overlap
against load) and relays its tokens. A worker that dies or is drained hands its requests to
other workers, where they are recomputed from the tokens already streamed, so streams continue
exactly; only requests no worker can take end with an ERROR finish (marked `worker_lost`, so the
router resubmits them). A resumable request (its client named it) whose Submit stream drops is
held for detach_grace_s, running on, until a router attaches to it (`Scheduler/Attach`) for a
reconnecting client; `kvmesh:request:<id>` in Redis says which scheduler holds it. Queue state,
the autoscaling signal, health checks and the rollout controller run beside it (fleet.py).

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
from contextlib import aclosing
from dataclasses import dataclass, field

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
from kvmesh.services.scheduler.session import CallAborted, serve_session
from kvmesh.services.scheduler.worker_loop import Fetch, LogprobsTokenEvent, WorkerLoop
from kvmesh.services.tls import MeshIdentity, RegisteredPeers, mesh_channel, mesh_identity, mesh_server_credentials
from kvmesh.v1 import generation_pb2 as gen
from kvmesh.v1 import kvcache_pb2, kvcache_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger("kvmesh.scheduler")

_REASONS = {r: gen.FinishReason.Value(r.name) for r in FinishReason}
NO_WORKER_WAIT_S = 3.0
HOLD_TTL_S = 3.0  # a holder key outlives its scheduler by at most this
MAX_VERSION_CHARS = 128
# A prompt is looked up for pages to fetch when at least this many of its pages are not in its
# worker's pool; kvcache's answer is awaited this long at most (then the prompt is computed).
MIN_FETCH_PAGES = 2
FETCH_LOOKUP_TIMEOUT_S = 0.25


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    """Submit: token ids in, a stream of TokenEvents out, the last with its finish reason. It
    trusts no caller: the request is checked by the router's rules (kvmesh.params) against the
    model of the pool's workers (token ids within its vocabulary, prompt plus max_new_tokens
    within its context, sampling values within their limits), and request_id and version are
    bounded. Errors: INVALID_ARGUMENT naming the field and the limit (also when the request cannot
    fit a worker's KV pool), UNAVAILABLE when no worker is ready, RESOURCE_EXHAUSTED with a
    `retry-after` hint when the pool is overloaded: the queue is full, the chosen worker could not
    start the request within max_queue_wait_s (overload.py), or it waited that long all the same
    without starting (then nothing was streamed). Load alone never ends a request with ERROR.
    A resubmitted request carries the tokens already streamed (output_token_ids) and continues
    after them. Attach: see its docstring."""

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
        self.worker_records: dict[str, dict] = {}  # the pool's registered workers, by id (all schedulers')
        self.held: dict[str, HeldRequest] = {}  # request id -> its stream, across all workers
        self._hold_now = asyncio.Event()  # a new resumable request: write its holder key now
        self.owner: dict[str, WorkerLoop] = {}  # request id -> the worker loop running it now
        self.outcomes = Outcomes()  # finished requests per version: rollouts and autoscaling read them
        self.health = HealthChecks(self)
        self.autoscale = AutoscaleSignal(self)
        self._ramp_new_workers = False  # set once workers are known: later ones ramp up their admissions
        self.stopping = asyncio.Event()  # the server is in its grace period (serve() gives it the server's)

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

    async def peer_pages(self, worker: WorkerLoop, hashes: list[bytes]) -> kvcache_pb2.LookupResponse | None:
        """kvcache's index for a prompt `worker` would compute much of: how many of its leading
        pages each worker of the cluster holds (empty when kvcache did not answer in time). None,
        without asking, when nothing could be fetched: fetching is off, the worker holds or has in
        its tier all but a few pages, or no peer of its pool and version is registered (one
        worker, the usual `kvmesh up`: the submit then waits on no round trip)."""
        if not self.cfg.prefix_caching or self.cfg.kv_fetch == "never":
            return None
        local = worker.local_prefix_pages(hashes)
        if len(hashes) - local < MIN_FETCH_PAGES or local + worker.tier_run(hashes, local) >= len(hashes):
            return None
        stub = self._kvcache_stub
        peers = any(wid != worker.worker_id and r.get("version", "v1") == worker.version
                    for wid, r in self.worker_records.items())
        if stub is None or not peers:
            return None
        try:
            return await stub.Lookup(kvcache_pb2.LookupRequest(hashes=hashes), timeout=FETCH_LOOKUP_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return kvcache_pb2.LookupResponse()

    def plan_fetch(self, worker: WorkerLoop, hashes: list[bytes], holders: kvcache_pb2.LookupResponse | None) -> Fetch | None:
        """Where to read the pages of a prompt that `worker` would otherwise compute: its own tier,
        or the peer worker (same pool and version, any scheduler's; `holders`, from `peer_pages`)
        holding the longest run past what the worker holds. None when nothing is held elsewhere,
        too little, or reading it would not beat computing it (`fetch_pays`)."""
        if not self.cfg.prefix_caching or self.cfg.kv_fetch == "never":
            return None
        local = worker.local_prefix_pages(hashes)
        if len(hashes) - local < MIN_FETCH_PAGES:
            return None
        best = None
        if tiered := worker.tier_run(hashes, local):
            best = Fetch("", "tier", local, hashes[local : local + tiered])
        for held in holders.workers if holders is not None else ():
            record = self.worker_records.get(held.worker_id)
            if (held.worker_id == worker.worker_id or record is None or record.get("epoch") != held.epoch
                    or record.get("version", "v1") != worker.version):
                continue
            if held.pages > local + (len(best.hashes) if best else 0):
                best = Fetch(record["address"], "peer", local, hashes[local : held.pages])
        if best is None or len(best.hashes) < MIN_FETCH_PAGES:
            return None
        return best if self.cfg.kv_fetch == "always" or worker.fetch_pays(len(best.hashes)) else None

    def waiting_count(self) -> int:
        return sum(len(w.core.waiting) for w in self.workers.values() if w.alive)

    def retry_hint_s(self) -> float:
        """About how long the pool's work takes to drain: the tokens its requests still have to
        compute or generate over the serving workers' recent throughput (each worker's sum is
        kept up by submits and steps: a flood of refusals does not walk the queue for each)."""
        serving = [w for w in self.workers.values() if w.alive and not w.draining]
        tokens = sum(w.queued_tokens() for w in serving)
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

    async def Session(self, requests, context):
        """Submit calls over one stream, their events batched per step (session.py)."""
        try:
            async with aclosing(serve_session(requests, self.Submit, self.stopping)) as batches:
                async for batch in batches:
                    yield batch
        except CallAborted as e:  # the caller broke the session's protocol
            await context.abort(e.code, e.details)

    async def _abort(self, context, span, code: grpc.StatusCode, message: str):
        span.set_status(telemetry.Status(telemetry.StatusCode.ERROR, f"{code.name}: {message}"))
        await context.abort(code, message)

    async def _submit(self, request, context, span):
        held = await self._admit(request, context, span)
        async for event in self._relay(held, context, span):
            yield event

    async def _admit(self, request, context, span) -> "HeldRequest":
        """Checks and queues a Submit's request on a worker; aborts the call with its status otherwise."""
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
        holders = await self.peer_pages(worker, hashes)
        if holders is not None and (self.placement.policy == "kv" or not worker.alive or worker.draining):
            # Submits placed while kvcache answered are on their workers now (a burst's first
            # requests would otherwise all go where the idle cluster they saw put them): choose
            # again, with nothing awaited from here to the submit. Round-robin keeps its turn
            # unless that worker left meanwhile.
            worker = self.pick_worker(hashes, request.version)
            if worker is None:
                await self._no_worker(request, context, span)
        try:  # a request that can never fit is a bad request, whatever the load
            worker.core.check_fits(req)
        except InvalidRequest as e:
            await self._abort(context, span, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        wait_s = worker.estimated_wait_s(req)
        if (retry_s := overload_retry_s(wait_s, self.cfg.max_queue_wait_s)) is not None:
            await self._refuse_for_load(context, span, f"overloaded: a request queued now would wait about {wait_s:.0f} s "
                                        f"to start, over what max_queue_wait_s={self.cfg.max_queue_wait_s:g} allows", retry_s)
        req.eos_token_ids = tuple(worker.info.eos_token_ids)
        fetch = self.plan_fetch(worker, hashes, holders)
        if (earlier := self.held.get(req.request_id)) is not None:
            if earlier.finish is None:
                await self._abort(context, span, grpc.StatusCode.INVALID_ARGUMENT,
                                  f"request_id {req.request_id!r} is already in use")
            self._release(earlier)  # finished, kept for a client that might resume it: the id is free again
        expected_pages = worker.prefix_pages(hashes)
        if fetch is not None:
            expected_pages = max(expected_pages, fetch.first_page + len(fetch.hashes))
        try:
            queue = worker.submit(req, hashes, expected_pages, fetch=fetch)
        except (InvalidRequest, ValueError) as e:
            await self._abort(context, span, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        span.set_attributes({"kvmesh.request_id": req.request_id, "kvmesh.worker_id": worker.worker_id,
                             "kvmesh.expected_prefix_pages": expected_pages, "kvmesh.resumes": request.resumes})
        if fetch is not None:
            span.set_attributes({"kvmesh.fetch_source": fetch.kind, "kvmesh.fetch_pages": len(fetch.hashes)})
        held = HeldRequest(req, queue, hashes, worker, request.resumable, request.resumes)
        self.held[req.request_id] = held
        self.owner[req.request_id] = worker
        if held.resumable:
            self._hold_now.set()  # its holder key, written off this path
        return held

    async def Attach(self, request, context):
        """Relays a request held here to a new caller (a router whose client resumed it): the first
        event carries every output token so far (and the finish, if it came), then the stream goes
        on as its Submit's. An open relay of it is taken over. NOT_FOUND when it is not held here,
        INVALID_ARGUMENT when `prompt_token_ids` is not its prompt."""
        held = self.held.get(request.request_id)
        if held is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id {request.request_id!r} is not held by this scheduler")
        if list(request.prompt_token_ids) != held.req.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt_token_ids: differ from the prompt of request {request.request_id!r}")
        if held.expiry is not None:
            held.expiry.cancel()
            held.expiry = None
        if held.relay is not None:  # its old caller has not noticed yet that it is gone: stop that relay
            held.relay.cancel()
        held.resumes += 1
        log.info("request %s resumed by a new caller after %d tokens", request.request_id, len(held.req.output_token_ids))
        span = self.tracer.start_span("kvmesh.schedule", kind=telemetry.SpanKind.SERVER,
                                      context=telemetry.context_from_metadata(context.invocation_metadata()),
                                      attributes={"kvmesh.request_id": request.request_id, "kvmesh.resumes": held.resumes})
        events = self._relay(held, context, span, self._catch_up(held))
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()
            span.end()

    async def _relay(self, held: "HeldRequest", context, span, first: scheduler_pb2.TokenEvent | None = None):
        """Streams `held`'s events (after `first`) to this call until its finish. When the call
        drops first, a resumable request is held for detach_grace_s (unless the call's deadline
        passed); any other is cancelled at once. A relay taken over by an Attach leaves it be."""
        me = held.relay = asyncio.current_task()
        rid, delivered = held.req.request_id, False
        queue_span_done = False
        try:
            if first is not None:
                delivered = held.finish is not None
                yield first
            while held.finish is None:
                event: TokenEvent = await held.queue.get()
                if event.refused:  # never started: the client may retry elsewhere or later
                    held.finish, delivered = _event_to_proto(event, held.worker), True  # nothing to hold
                    await self._refuse_for_load(context, span, event.message, self.retry_hint_s())
                if held.resumable and not held.announced.is_set():
                    await self._announced(held)
                worker = self.owner.get(rid, held.worker)
                message = _event_to_proto(event, worker)
                if event.finish_reason is not None:
                    self._finished(held, worker, message, event, span)
                if not queue_span_done and (held.req.first_scheduled_time is not None or held.finish is not None):
                    queue_span_done = self._record_queue_span(held.req, span)
                # The caller may close the call as soon as it has the finish, before this generator resumes.
                delivered = held.finish is not None
                yield message
            delivered = True
        finally:
            if held.relay is me:
                held.relay = None
                # A session call's finish may still wait in its outbox: then it was not delivered (session.py).
                delivered = delivered and not getattr(context, "finish_unsent", False)
                remaining = context.time_remaining()
                if delivered or not held.resumable or not self.cfg.detach_grace_s or (remaining is not None and remaining <= 0):
                    self._release(held)
                else:
                    self._detach(held)

    async def _announced(self, held: "HeldRequest") -> None:
        """Waits (bounded) for the request's holder key: a client never has a token of a request
        a router could not find to resume."""
        try:
            await asyncio.wait_for(held.announced.wait(), HOLD_TTL_S / 3)
        except TimeoutError:
            pass  # Redis is slow or down: stream on; a resume finds it once the key is written

    def _finished(self, held: "HeldRequest", worker: WorkerLoop, message, event: TokenEvent, span) -> None:
        """The request's last event: it says whether its worker was lost (the router may resubmit)."""
        req = held.req
        message.resumes = held.resumes
        message.worker_lost = event.finish_reason is FinishReason.ERROR and (not worker.alive or worker.draining)
        held.finish = message
        self.outcomes.record(worker.version, req)
        span.set_attributes({"kvmesh.finish_reason": event.finish_reason.value, "kvmesh.preemptions": req.num_preemptions,
                             "kvmesh.cached_prompt_tokens": req.num_cached_prompt_tokens})
        if event.finish_reason is FinishReason.ERROR:
            span.set_status(telemetry.Status(telemetry.StatusCode.ERROR, event.message))

    def _catch_up(self, held: "HeldRequest") -> scheduler_pb2.TokenEvent:
        """One event with every output token so far (events still queued are in `req` already),
        and the finish when the request has finished."""
        rid = held.req.request_id
        worker = self.owner.get(rid, held.worker)
        while held.finish is None and not held.queue.empty():
            event = held.queue.get_nowait()
            if event.finish_reason is not None:
                self._finished(held, worker, _event_to_proto(event, worker), event, telemetry.trace.INVALID_SPAN)
        message = scheduler_pb2.TokenEvent()
        message.CopyFrom(held.finish if held.finish is not None else _event_to_proto(None, worker))
        message.resumes = held.resumes
        message.ClearField("token_ids")
        message.ClearField("logprobs")
        message.token_ids.extend(held.req.output_token_ids)
        message.logprobs.extend(held.req.output_logprobs)
        return message

    def _detach(self, held: "HeldRequest") -> None:
        """Its caller is gone: it runs on (or stays finished) for detach_grace_s, for an Attach."""
        held.expiry = asyncio.get_running_loop().call_later(self.cfg.detach_grace_s, self._expire, held)
        log.info("request %s lost its caller: held %gs for it to resume", held.req.request_id, self.cfg.detach_grace_s)

    def _expire(self, held: "HeldRequest") -> None:
        if held.relay is None and self.held.get(held.req.request_id) is held:
            log.info("request %s was not resumed within %gs: cancelled", held.req.request_id, self.cfg.detach_grace_s)
            self._release(held)

    def _release(self, held: "HeldRequest") -> None:
        """Forgets the request; cancels it (freeing its pages) unless it finished."""
        rid = held.req.request_id
        if self.held.get(rid) is not held:
            return
        del self.held[rid]
        if held.expiry is not None:
            held.expiry.cancel()
        owner = self.owner.pop(rid, held.worker)
        owner.done(rid, held.hashes, held.finish is not None)

    async def hold_requests(self, address: str) -> None:
        """Keeps `kvmesh:request:<id>` -> this scheduler for every resumable request held here, so a
        router can find it to attach: a new one's key is written at once, and all of them are
        renewed every HOLD_TTL_S / 3. A wake-up for new requests writes theirs alone (a burst of n
        submits is n writes, not n^2 / 2)."""
        renew_at = 0.0
        while True:
            self._hold_now.clear()  # before the snapshot: a request added during the write is written next
            renew = time.monotonic() >= renew_at
            if renew:
                renew_at = time.monotonic() + HOLD_TTL_S / 3
            batch = [held for held in self.held.values() if held.resumable and (renew or not held.announced.is_set())]
            if batch:
                try:
                    await self.registry.hold_requests([h.req.request_id for h in batch], address, HOLD_TTL_S)
                    for held in batch:
                        held.announced.set()
                except Exception as e:  # Redis down: held requests run on; a resume finds them once it is back
                    log.warning("holder keys: %s", e)
            try:
                await asyncio.wait_for(self._hold_now.wait(), max(0.0, renew_at - time.monotonic()))
            except TimeoutError:
                pass

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
        _resume_output(req, request, model.vocab_size)
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
                target.submit(req, hashes, target.prefix_pages(hashes), queue=queue)
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
        self.worker_records = {r["id"]: r for r in records}  # every scheduler's: page fetches read from any of them
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
            log.info("scheduling on worker %s (%s %s) at %s, %d tokens a step", loop.worker_id, self.cfg.pool, loop.version,
                     loop.address, loop.core.config.max_batched_tokens)
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


def _resume_output(req: Request, request, vocab_size: int) -> None:
    """Continues `req` after the tokens its client already has (a resubmit after a failure).
    InvalidRequest naming the field when they cannot be this request's output so far."""
    output = list(request.output_token_ids)
    if not output:
        return
    if len(output) >= req.stopping.max_new_tokens:
        raise InvalidRequest("output_token_ids", f"has {len(output)} tokens, not fewer than max_new_tokens "
                                                 f"({req.stopping.max_new_tokens}): nothing is left to generate")
    if (bad := max(output)) >= vocab_size:
        raise InvalidRequest("output_token_ids", f"holds {bad}, outside the vocabulary of {vocab_size}")
    logprobs = list(request.output_logprobs)
    if len(logprobs) != len(output):
        raise InvalidRequest("output_logprobs", f"has {len(logprobs)} values for {len(output)} output tokens")
    req.output_token_ids, req.output_logprobs = output, logprobs
    req.token_ids = req.prompt_token_ids + output


@dataclass(eq=False)
class HeldRequest:
    """A request as Submit and Attach relay it. The worker loop fills `queue`; one relay (the
    caller's stream) reads it at a time. A resumable request whose relay drops is held, running on
    with its tokens in `req`, for detach_grace_s (the `expiry` timer), then cancelled."""

    req: Request
    queue: asyncio.Queue
    hashes: list[bytes]
    worker: WorkerLoop  # where it was placed (`owner` says where it runs now)
    resumable: bool
    resumes: int
    finish: scheduler_pb2.TokenEvent | None = None  # its last event, once read from the queue
    announced: asyncio.Event = field(default_factory=asyncio.Event)  # its holder key is written
    relay: asyncio.Task | None = None
    expiry: asyncio.TimerHandle | None = None


def _wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as epoch nanoseconds (span timestamps are wall-clock)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def _event_to_proto(event: TokenEvent | None, worker: WorkerLoop) -> scheduler_pb2.TokenEvent:
    m = scheduler_pb2.TokenEvent(worker_id=worker.worker_id, version=worker.version)
    if event is None:
        return m
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
        m.transferred_prompt_tokens, m.transfer_source = req.num_transferred_prompt_tokens, req.transfer_source
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
    service.stopping = server.stopping
    address = advertised_address(common, server.port)
    service.identify(address)
    registry.on_close.append(service.leases.release_all)  # a clean stop hands its workers over at once
    tasks = [asyncio.create_task(service.discover()), asyncio.create_task(service.publish_queue_state()),
             asyncio.create_task(service.hold_requests(address)),
             asyncio.create_task(service.leases.keep(service.lost_worker)), asyncio.create_task(service.leader.run()),
             asyncio.create_task(RolloutController(service).run())]
    if cfg.health_check_interval_s:
        tasks.append(asyncio.create_task(service.health.run()))
    print(f"scheduler for pool {cfg.pool!r} ready on {address}", flush=True)
    record = {"address": address, "pool": cfg.pool,
              "metrics": advertised_address(common, metrics_port) if metrics_port else ""}
    await serve_until_stopped(server, registry, "scheduler", address, record, tasks=tuple(tasks))
