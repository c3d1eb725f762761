"""One worker's continuous batching loop, as the scheduler runs it.

A `WorkerLoop` holds the worker's page pool (this scheduler owns the worker's pages) and the
scheduler core, and drives one long-lived `Worker/Step` stream: one plan and one result per step.
With overlapped steps (`overlap_steps`), the next step's plan goes out while the worker computes
the current one (two plans out at most; Scheduler.schedule(ahead=True)), so the worker does not
wait for the scheduler between steps. After
each step it hands tokens to the requests' streams, and its publisher sends the step's page
events (prefix-index changes, page counts) to the kvcache service write-behind (kv_events.py).
When the stream breaks it hands its requests to `on_gone` (the service moves them to other
workers), and fails with an ERROR finish only those nobody can take.

A request submitted with a `Fetch` (part of its prompt's KV is on a peer worker or in this
worker's host-memory tier, and reading it is cheaper than computing it) is queued only after the
fetch: the loop reserves pages for it, asks its worker to fill them (`Worker/FetchPages`, off the
step path: steps go on meanwhile), publishes the pages that arrived to the prefix index, and
queues the request, whose admission then finds them as a prefix hit. Pages that did not arrive
(the source died, the pages were evicted there) are computed as usual.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import grpc

from kvmesh import telemetry
from kvmesh.metrics import SchedulerMetrics
from kvmesh.services import wire
from kvmesh.services.config import SchedulerServiceConfig
from kvmesh.services.scheduler.core import Scheduler, TokenEvent
from kvmesh.services.scheduler.kv_events import KVPublisher, TracedPagePool
from kvmesh.services.scheduler.overload import OutputLengths, Queued, QueueWalk, Throughput, decode_step_s
from kvmesh.services.scheduler.placement import WorkerView, discount
from kvmesh.services.scheduler.request import FinishReason, Request, Status
from kvmesh.step import SampledToken, StepPlan, StepResult
from kvmesh.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("kvmesh.scheduler")


class WorkerGone(Exception):
    pass


# A fetch's fixed cost beside its bytes (two calls and a page reservation), and the transfer rate
# assumed until one has been measured: what `fetch_pays` weighs against recomputing.
FETCH_OVERHEAD_S = 0.01
DEFAULT_TRANSFER_BYTES_PER_S = 200e6
DEFAULT_PREFILL_TOKENS_PER_S = 500.0


ENDED = (FinishReason.STOP, FinishReason.EOS, FinishReason.LENGTH)  # not cut short by a client or a failure


def leading_run(hashes: list[bytes], start: int, held) -> int:
    """How many of `hashes[start:]`, from the first on, satisfy `held`."""
    n = 0
    for h in hashes[start:]:
        if not held(h):
            break
        n += 1
    return n


@dataclass
class Fetch:
    """Pages of a request's prompt to read before it is queued: `hashes` are its pages
    `first_page ..`, held by `source` (a peer worker's address; "" this worker's tier)."""

    source: str
    kind: str  # "peer" or "tier"
    first_page: int
    hashes: list[bytes]
    task: asyncio.Task | None = field(default=None, repr=False)


@dataclass
class SentPlan:
    """A plan on its way to the worker: its step number, when its planning began and how long it
    took, and when it was sent."""

    step: int
    plan: StepPlan
    scheduled_at: float
    schedule_s: float
    sent_at: float


@dataclass
class WalkedQueue:
    """The wait estimate's walk of a worker's queue, valid while the worker's epoch stays `epoch`:
    its first `count` waiting requests walked, `last` the last of them (a request inserted ahead
    of it moves it, which shows that the walk no longer matches the queue), `oldest` the earliest
    arrival among those not yet started."""

    walk: QueueWalk
    epoch: int
    count: int = 0
    last: Request | None = None
    oldest: float = float("inf")


@dataclass
class LogprobsTokenEvent(TokenEvent):
    """A token event that carries what the worker sent beside the token: its alternatives and,
    with a first token, the prompt's logprobs (SamplingParams.logprobs, prompt_logprobs)."""

    sampled: SampledToken | None = None


def with_logprobs(events: list[TokenEvent], result: StepResult) -> list[TokenEvent]:
    """`events`, those whose token came with alternatives or prompt logprobs carrying them."""
    detailed = {t.seq_id: t for t in result.tokens if t.top_ids or t.prompt is not None}
    if not detailed:
        return events
    return [LogprobsTokenEvent(**vars(e), sampled=detailed[e.request.request_id])
            if e.token_id is not None and e.request.request_id in detailed else e for e in events]


class WorkerLoop:
    """Continuous batching for one worker."""

    def __init__(self, record: dict, info: worker_pb2.WorkerInfo, cfg: SchedulerServiceConfig, kvcache,
                 metrics: SchedulerMetrics, on_gone=None, owner: str = "", lease_token: int = 0):
        self.worker_id = record["id"]
        self.owner, self.lease_token = owner, lease_token  # our lease on the worker: sent with the stream and page events
        self.address = record["address"]
        self.info = info
        self.version = info.version or "v1"
        self.draining = False  # failed its health checks: takes nothing new
        # Plan the next step while one is out (SchedulerServiceConfig.overlap_steps); with auto, a CPU
        # worker's results say whether its step leaves a core to plan on (`spare_cores`).
        on_accelerator = (info.device or "cpu") != "cpu"
        self.overlap = cfg.batching == "continuous" and (cfg.overlap_steps == "on" or cfg.overlap_steps == "auto" and on_accelerator)
        self.overlap_follows_cores = cfg.batching == "continuous" and cfg.overlap_steps == "auto" and not on_accelerator
        self.ramp = None  # an AdmissionRamp while a late-joining worker takes load gradually
        self.task: asyncio.Task | None = None
        self.stub: worker_pb2_grpc.WorkerStub | None = None
        self.on_gone = on_gone  # (loop, reason) -> moves its requests to other workers when the worker dies
        self.health_checks: set[str] = set()  # request ids of health checks in flight (never moved)
        self.pool = TracedPagePool(self.worker_id, info.num_pages, info.page_size, cfg.prefix_caching)
        self.core = Scheduler(self.pool, cfg.core_config(info.step_tokens), max_context=info.max_context or None)
        self.tier: set[bytes] = set()  # the hashes in the worker's host-memory tier, as it reports them
        tier_pages = info.offload_bytes // info.page_bytes if info.page_bytes else 0
        self.publisher = KVPublisher(self.pool, self.worker_id, info.epoch, lease_token, kvcache, self.tier, tier_pages)
        self.fetching: dict[str, tuple[Request, Fetch]] = {}  # requests whose pages are being fetched
        self.transfer_bytes_per_s = DEFAULT_TRANSFER_BYTES_PER_S  # measured by fetches (moving average)
        self.streams: dict[str, asyncio.Queue] = {}
        self.queued_hashes: Counter[bytes] = Counter()  # prompt pages of this worker's requests
        self.expected_hits: dict[str, int] = {}  # request id -> prompt tokens expected from the cache
        self.wake = asyncio.Event()
        self.alive = True
        # Cumulative seconds per part of a step: scheduling, the worker's forward pass, the rest
        # of the round trip (wire and (de)serialisation), and applying the result.
        self.timing = {"steps": 0, "schedule_s": 0.0, "forward_s": 0.0, "wire_s": 0.0, "update_s": 0.0}
        self.throughput = Throughput()  # recent step rates: what the overload estimate and fetch_pays go by
        self.output_lengths = OutputLengths()  # how long outputs that may end on their own ran: the estimate's too
        self.metrics = metrics.worker(self.worker_id)
        self._step_hist, self._batch_hist, self._tokens_hist = self.metrics.step, self.metrics.batch_size, self.metrics.step_tokens
        self._preemptions_seen = self._deferred_seen = 0
        self._load, self._load_epoch, self._load_summed_at = 0, 0, -1  # queued_tokens' running sum
        self._walked: WalkedQueue | None = None  # the wait estimate's walk of the queue, kept within an epoch

    def view(self, hashes: list[bytes]) -> WorkerView:
        """What placement needs to know about this worker for a prompt with these page hashes."""
        stats = self.pool.stats()
        local = self.local_prefix_pages(hashes)
        queued = local - leading_run(hashes, 0, self.pool.index.__contains__)  # a queued prompt's, not cached yet
        return WorkerView(self.worker_id, local + self.tier_run(hashes, local), self.queued_tokens() / self.pool.page_size,
                          stats.used + stats.cached, queued, stats.free + stats.cached)

    def prefix_pages(self, hashes: list[bytes]) -> int:
        """Leading pages of the prompt this worker holds, will hold (a queued prompt's) or has in its
        tier (reading them back costs little)."""
        local = self.local_prefix_pages(hashes)
        return local + self.tier_run(hashes, local)

    def queued_tokens(self) -> int:
        """`estimated_tokens` summed over its requests, queued or still fetching pages (a request
        whose fetch is out is this worker's work too: a burst placed meanwhile must see it): summed
        again after a step or a removal, and kept up by each submit in between, so a burst of n
        submits costs O(n), not O(n^2)."""
        if self._load_epoch != self._load_summed_at:
            self._load = (sum(self.estimated_tokens(r) for r in self.core.requests.values())
                          + sum(self.estimated_tokens(r) for r, _ in self.fetching.values()))
            self._load_summed_at = self._load_epoch
        return self._load

    def estimated_wait_s(self, req: Request) -> float:
        """Seconds until `req`, queued now, would start (overload.QueueWalk over this worker's
        running requests and the waiting ones admitted before it), or the longest one of those has
        waited so far if more (a queue moving slower than the estimate, the machine slowed down,
        shows there)."""
        now = time.monotonic()
        walked = self._walk_ahead_of(req)
        rate = self.throughput.prefill_tokens_per_s
        wait = walked.walk.start_s(self._queued(req).pages, rate) if rate else 0.0
        return max(wait, now - min(walked.oldest, now))

    def _walk_ahead_of(self, req: Request) -> WalkedQueue:
        """The queue walked up to `req`'s place, kept from the last estimate when nothing changed
        since but submits behind its end (a step, a removal or an insertion ahead of it walks it
        again from the running requests): a burst of n submits walks each request once."""
        ahead, waiting, walked = self.core.ahead_count(req), self.core.waiting, self._walked
        if (walked is None or walked.epoch != self._load_epoch or walked.count > ahead
                or (walked.count and waiting[walked.count - 1] is not walked.last)):
            lengths = self.output_lengths  # outputs that may end on their own: as long as recent ones ran
            slots = min(self.core.seq_limit, self.core.config.max_num_seqs)
            walk = QueueWalk([self._queued(r, lengths) for r in self.core.running], slots, self.pool.num_pages,
                             decode_step_s(self.throughput))
            walked = self._walked = WalkedQueue(walk, self._load_epoch)
        for r in waiting[walked.count:ahead]:
            walked.walk.admit(self._queued(r, self.output_lengths))
            if r.first_scheduled_time is None:
                walked.oldest = min(walked.oldest, r.arrival_time)
            walked.last = r
        walked.count = ahead
        return walked

    def _queued(self, r: Request, lengths: OutputLengths | None = None) -> Queued:
        return Queued.of(r, max(r.num_computed_tokens, self.expected_hits.get(r.request_id, 0)), self.pool.page_size,
                         lengths)

    def estimated_tokens(self, r: Request) -> int:
        """Tokens still to compute (prompt not yet computed nor expected from the cache) or to generate."""
        q = self._queued(r)
        return q.prefill + q.outputs

    def local_prefix_pages(self, hashes: list[bytes]) -> int:
        """Leading pages of a prompt this worker's pool holds or will hold (a queued prompt's)."""
        return leading_run(hashes, 0, lambda h: h in self.pool.index or h in self.queued_hashes)

    def tier_run(self, hashes: list[bytes], start: int) -> int:
        """How many of `hashes[start:]`, leading, the worker's tier holds."""
        return leading_run(hashes, start, self.tier.__contains__)

    def fetch_pays(self, pages: int) -> bool:
        """Whether reading `pages` pages beats computing their tokens, by this worker's measured
        rates: its recent tokens per second of step, and the transfer rate of its past fetches."""
        if pages <= 0 or not self.info.page_bytes:
            return False
        transfer_s = FETCH_OVERHEAD_S + pages * self.info.page_bytes / self.transfer_bytes_per_s
        compute_s = pages * self.pool.page_size / (self.throughput.tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S)
        return transfer_s < compute_s

    def submit(self, req: Request, hashes: list[bytes], expected_hit_pages: int,
               queue: asyncio.Queue | None = None, fetch: Fetch | None = None) -> asyncio.Queue:
        """Queues the request (ValueError or InvalidRequest, changing nothing, if it cannot be).
        `queue` is the stream of a request moved here from a drained worker; with `fetch`, the
        request is queued once those pages are read."""
        self.core.check_fits(req)
        if req.request_id in self.fetching:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        if fetch is None or self.stub is None:
            self.core.add(req)  # first: it rejects a request_id in use before any state is touched
        elif req.request_id in self.core.requests or req.request_id in self.core.padding:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        else:
            self.fetching[req.request_id] = (req, fetch)
            fetch.task = asyncio.create_task(self._fetch_then_queue(req, fetch))
        if req.traceparent:
            self.pool.traceparents[req.request_id] = req.traceparent
        self.expected_hits[req.request_id] = expected_hit_pages * self.pool.page_size
        if self._load_summed_at == self._load_epoch:
            self._load += self.estimated_tokens(req)
        queue = queue or asyncio.Queue()
        self.streams[req.request_id] = queue
        self.queued_hashes.update(hashes)
        self.wake.set()
        return queue

    def done(self, request_id: str, hashes: list[bytes], finished: bool) -> None:
        """The request's stream ended; cancel it here unless it finished."""
        self.streams.pop(request_id, None)
        self.fetching.pop(request_id, None)  # a fetch in flight gives its pages back and queues nothing
        self.expected_hits.pop(request_id, None)
        discount(self.queued_hashes, hashes)
        self._load_epoch += 1
        if not finished:
            self.core.abort(request_id)  # its kvmesh.kv.release span takes the trace context popped below
            self.wake.set()
        self.pool.traceparents.pop(request_id, None)

    async def _fetch_then_queue(self, req: Request, fetch: Fetch) -> None:
        """Reserves pages, has the worker fill them from the source, publishes those that arrived
        and queues the request (which then finds them as a prefix hit)."""
        seq_id, n, nbytes, outcome = f"fetch:{req.request_id}", 0, 0, "failed"
        parent = telemetry.context_from_traceparent(self.pool.traceparents.get(req.request_id, ""))
        span = self.pool.tracer.start_span("kvmesh.kv.fetch", context=parent, attributes={
            "kvmesh.worker_id": self.worker_id, "kvmesh.request_id": req.request_id, "kvmesh.fetch_source": fetch.kind,
            "kvmesh.fetch_from": fetch.source or self.worker_id, "kvmesh.fetch_pages": len(fetch.hashes)})
        self.pool.open(seq_id, [])
        try:
            pages = self.pool.grow(seq_id, len(fetch.hashes) * self.pool.page_size)
            if pages is None:
                outcome = "no_pages"
                return
            started = time.perf_counter()
            timeout = 2.0 + 4 * len(pages) * self.info.page_bytes / self.transfer_bytes_per_s
            try:
                answer = await self.stub.FetchPages(worker_pb2.FetchPagesRequest(
                    source=fetch.source, hashes=fetch.hashes, page_ids=pages, timeout_s=timeout), timeout=timeout + 1,
                    metadata=((wire.LEASE_TOKEN_METADATA, str(self.lease_token)),))
                n, nbytes = answer.pages, answer.bytes
                if answer.error:
                    log.warning("fetch for %s from %s: %d of %d pages (%s); the rest is computed", req.request_id,
                                fetch.source or "the tier", n, len(pages), answer.error)
            except grpc.aio.AioRpcError as e:
                log.warning("fetch for %s failed (%s); its prompt is computed", req.request_id, e.code().name)
            elapsed = time.perf_counter() - started
            outcome = "ok" if n == len(pages) else "partial" if n else "failed"
            if n >= 4 and elapsed > 0:  # a rate from a handful of pages is mostly the fixed cost
                self.transfer_bytes_per_s = 0.7 * self.transfer_bytes_per_s + 0.3 * nbytes / elapsed
            if self.fetching.get(req.request_id, (None,))[0] is req:
                self.pool.adopt(seq_id, fetch.hashes[:n])
        finally:
            self.pool.release(seq_id)
            span.set_attributes({"kvmesh.fetched_pages": n, "kvmesh.fetched_bytes": nbytes, "kvmesh.outcome": outcome})
            span.end()
            self.metrics.transfers[(fetch.kind, outcome)].inc()
            self.metrics.transfer_bytes[fetch.kind].inc(nbytes)
            if self.fetching.get(req.request_id, (None,))[0] is req:  # still wanted here
                del self.fetching[req.request_id]
                req.fetched = (fetch.first_page, n, fetch.kind)
                try:
                    self.core.add(req)
                except ValueError as e:
                    self._fail_unqueued(req, str(e))
                self._load_epoch += 1
                self.wake.set()

    def _fail_unqueued(self, req: Request, message: str) -> None:
        queue = self.streams.get(req.request_id)
        if queue is not None:
            req.status, req.finish_reason = Status.FINISHED, FinishReason.ERROR
            queue.put_nowait(TokenEvent(req, None, None, FinishReason.ERROR, message))

    def take_all(self) -> list[tuple[Request, asyncio.Queue]]:
        """Every request with its stream, removed from this worker and reset for recompute elsewhere."""
        moved = []
        for req, fetch in self.fetching.values():
            fetch.task.cancel()  # its pages go back as the task ends
            req.fetched = None
            queue = self.streams.pop(req.request_id, None)
            if queue is not None:
                moved.append((req, queue))
        self.fetching.clear()
        self._load_epoch += 1
        for req in self.core.take_all():
            queue = self.streams.pop(req.request_id, None)
            self.expected_hits.pop(req.request_id, None)
            if queue is not None:
                moved.append((req, queue))
        self.queued_hashes.clear()
        self.publisher.after_step()
        return moved

    def stop(self) -> None:
        """Ends the batching loop now (a hung worker never answers its step)."""
        self.alive = False
        if self.task is not None:
            self.task.cancel()

    async def run(self, channel: grpc.aio.Channel) -> None:
        # Our pool starts empty, as the worker's does on a new step stream; the publisher's first call
        # gives kvcache this worker's whole (empty) index, replacing what an earlier loop left.
        shipper = asyncio.create_task(self.publisher.run())
        self.stub = worker_pb2_grpc.WorkerStub(channel)
        call = self.stub.Step(metadata=((wire.LEASE_TOKEN_METADATA, str(self.lease_token)),
                                        (wire.SCHEDULER_METADATA, self.owner)))
        step = 0
        out: deque[SentPlan] = deque()  # plans sent whose results have not come back (two at most)
        pending_read = None  # a read left open while idle: it completes only if the stream ends
        reason = "stopped"
        read_at = done_at = 0.0  # when the last result was read, and when it was applied

        async def send(ahead: bool) -> None:
            """Plans the next step (`ahead`: while one is out) and sends it; a plan ahead with nothing in it is not sent."""
            nonlocal step
            t0 = time.perf_counter()
            plan = self.schedule(ahead)
            if ahead and not (plan.scheduled or plan.dropped):
                return
            step += 1
            self._count_admissions(plan)
            t1 = time.perf_counter()
            await call.write(wire.plan_to_proto(step, plan))
            out.append(SentPlan(step, plan, t0, t1 - t0, time.perf_counter()))
            if ahead:
                self.metrics.steps_ahead.inc()

        try:
            while True:
                if not out and not self.core.has_unfinished():
                    self.publisher.after_step()
                    self.wake.clear()
                    pending_read = pending_read or asyncio.ensure_future(call.read())
                    woken = asyncio.ensure_future(self.wake.wait())
                    await asyncio.wait({pending_read, woken}, return_when=asyncio.FIRST_COMPLETED)
                    if pending_read.done():
                        woken.cancel()
                        pending_read.result()  # raises the stream's error, if it has one
                        raise WorkerGone("the worker closed its step stream")
                if not out:
                    await send(ahead=False)
                # With one step out, the next is planned and sent before its result comes back, so
                # the worker goes from one step to the next without waiting for this loop.
                if self.overlap and not self.core.ahead_blocked:
                    await send(ahead=True)
                result = await (pending_read or call.read())
                pending_read = None
                t2 = time.perf_counter()
                if result is grpc.aio.EOF:
                    raise WorkerGone("the worker closed its step stream")
                sent = out.popleft()
                plan = sent.plan
                if result.step != sent.step:
                    raise WorkerGone(f"the worker answered step {result.step} where step {sent.step} was next")
                # The worker began this step once it had the plan and had sent the last result.
                round_trip, read_at = t2 - max(sent.sent_at, read_at), t2
                if result.error:
                    self._fail([c.seq_id for c in plan.scheduled], f"worker {self.worker_id} step failed: {result.error}")
                    done_at = time.perf_counter()
                    continue
                step_result = wire.result_from_proto(result)
                self._note_tier(step_result)
                if self.overlap_follows_cores and self.overlap != (step_result.spare_cores > 0):
                    self.overlap = step_result.spare_cores > 0
                    log.info("worker %s: steps %s (its step leaves %d of the host's cores)", self.worker_id,
                             "overlapped" if self.overlap else "no longer overlapped", step_result.spare_cores)
                events = self.core.update(plan, step_result)
                self._note_finishes(events)
                self._dispatch(with_logprobs(events, step_result))
                for seq_id, why in step_result.failed.items():
                    self._fail([seq_id], f"worker {self.worker_id} failed the request" + (f": {why}" if why else ""))
                self.publisher.after_step()
                began, done_at = max(sent.scheduled_at, done_at), time.perf_counter()
                self._account(sent.schedule_s, round_trip, result.forward_ms / 1000, done_at - t2)
                self.throughput.record(plan.num_tokens, done_at - began, len(plan.scheduled))
                self._step_hist.observe(round_trip)
                self._batch_hist.observe(len(plan.scheduled))
                self._tokens_hist.observe(plan.num_tokens)
        except (grpc.aio.AioRpcError, WorkerGone) as e:
            log.error("worker %s is gone: %s", self.worker_id, e)
            reason = f"its step stream broke: {e.code().name if isinstance(e, grpc.aio.AioRpcError) else e}"
        finally:
            self.alive = False
            call.cancel()
            if self.on_gone is not None and (self.core.requests or self.fetching):
                try:
                    self.on_gone(self, reason)  # streams continue, recomputed on another worker
                except Exception:
                    log.exception("moving the requests of worker %s failed", self.worker_id)
            message = f"worker {self.worker_id} failed ({reason}) and no other worker could take over"
            for req, fetch in list(self.fetching.values()):  # not moved: nobody took them
                fetch.task.cancel()
                self._fail_unqueued(req, message)
            self.fetching.clear()
            self._fail(list(self.core.requests), message)
            self.publisher.close()
            await shipper

    def schedule(self, ahead: bool = False) -> StepPlan:
        """The next step's plan (the admission ramp's batch limit first, while it lasts); `ahead`:
        planned while a step is out, before its result (Scheduler.schedule)."""
        if self.ramp is not None:
            self.core.seq_limit = self.ramp.limit(time.monotonic())
            self.ramp = None if self.core.seq_limit >= self.core.config.max_num_seqs else self.ramp
        plan = self.core.schedule(ahead)
        self._load_epoch += 1  # requests admitted, preempted or given chunks: the queue changed
        self.pool.trace_opened()
        return plan

    def _note_finishes(self, events: list[TokenEvent]) -> None:
        """Output lengths of the requests that ended on their own or at max_new_tokens, for the estimate."""
        for e in events:
            if e.finish_reason in ENDED and not e.request.stopping.ignore_eos:
                self.output_lengths.record(len(e.request.output_token_ids))

    def _note_tier(self, result: StepResult) -> None:
        """The worker's tier changes, into our view of it and the page events kvcache gets."""
        changes = self.pool.index_changes
        for h in result.tier_evicted:
            self.tier.discard(h)
            changes.append((False, h))
        for h in result.tier_stored:
            self.tier.add(h)
            changes.append((True, h))

    def _account(self, schedule_s: float, round_trip_s: float, forward_s: float, update_s: float) -> None:
        """A step's parts: planning it, the worker's forward pass, the rest of its round trip (from
        when the worker could begin it), applying its result."""
        self._load_epoch += 1  # its tokens moved on, requests ended
        t = self.timing
        t["steps"] += 1
        t["schedule_s"] += schedule_s
        t["forward_s"] += forward_s
        t["wire_s"] += max(0.0, round_trip_s - forward_s)
        t["update_s"] += update_s

    def _count_admissions(self, plan) -> None:
        """Prefix cache queries and hits (in prompt tokens) at a request's first admission; preemptions;
        requests that waited for another's pages."""
        m = self.metrics
        for new in plan.new:
            req = self.core.requests.get(new.seq_id)
            if req is not None and req.num_preemptions == 0:
                m.prefix_queries.inc(len(req.prompt_token_ids))
                m.prefix_hits.inc(req.num_cached_prompt_tokens)
                m.hits_by_source["local"].inc(req.num_cached_prompt_tokens - req.num_transferred_prompt_tokens)
                if req.num_transferred_prompt_tokens:
                    m.hits_by_source[req.transfer_source].inc(req.num_transferred_prompt_tokens)
        if self.core.num_preemptions != self._preemptions_seen:
            m.preemptions.inc(self.core.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = self.core.num_preemptions
        if self.core.num_deferred != self._deferred_seen:
            m.prefix_waits.inc(self.core.num_deferred - self._deferred_seen)
            self._deferred_seen = self.core.num_deferred

    def publish_metrics(self, waiting_tokens: int) -> None:
        m = self.metrics
        m.running.set(len(self.core.running))
        m.waiting.set(len(self.core.waiting))
        m.token_queue.set(waiting_tokens)
        m.orphaned_pages.set(self.pages_held_by_finished())

    def pages_held_by_finished(self) -> int:
        """Pages in tables of sequences the core no longer tracks (neither requests nor a padded
        static batch's finished rows): a leak if ever above zero."""
        held = set()
        fetching = {f"fetch:{r}" for r in self.fetching}
        for seq_id, table in self.pool.tables.items():
            if seq_id not in self.core.requests and seq_id not in self.core.padding and seq_id not in fetching:
                held.update(table.page_ids)
        return len(held)

    def dispatch_expired(self, max_wait_s: float) -> None:
        """Refuses the requests that waited past `max_wait_s` without starting (their streams end RESOURCE_EXHAUSTED)."""
        if expired := self.core.expire_waiting(max_wait_s):
            self._load_epoch += 1
            self._dispatch(expired)

    def _dispatch(self, events: list[TokenEvent]) -> None:
        for event in events:
            queue = self.streams.get(event.request.request_id)
            if queue is not None:
                queue.put_nowait(event)

    def _fail(self, request_ids: list[str], message: str) -> None:
        self._load_epoch += 1
        for request_id in request_ids:
            event = self.core.abort(request_id, FinishReason.ERROR)
            queue = self.streams.get(request_id)
            if event is not None and queue is not None:
                event.message = message
                queue.put_nowait(event)
