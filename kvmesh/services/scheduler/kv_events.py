"""A worker's pages as its scheduler owns them, and the page events it publishes to kvcache.

The scheduler is the authority for the pages of the workers it owns: `TracedPagePool` is the
PagePool it decides with on the per-step path, recording which page hashes enter and leave the
worker's prefix index and giving each traced request a `kvmesh.kv.open` span (the pages it took
with its prefix hit) and a `kvmesh.kv.release` span (the pages it gave back).

`KVPublisher` sends those events to the kvcache service, which keeps the cluster-wide prefix
index (kvmesh.services.kvcache.index). A page counts as held by the worker while it is in its
pool's prefix index or in its host-memory tier (which the worker reports with each step: the
loop records those hashes as changes too), and a changed hash is sent as stored or evicted by
whether it is held when the call goes out. One call at a time, off the batching loop's path, each
carrying everything that changed since the last one and the pool's page counts. Its first call
for a worker, and every call after kvcache asked for it (`resync`: kvcache restarted) or after a
call failed, carries the whole index instead, so kvcache's copy is rebuilt from the owner.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from kvmesh import telemetry
from kvmesh.services.kvcache.pages import PagePool
from kvmesh.v1 import kvcache_pb2

log = logging.getLogger("kvmesh.scheduler")

RETRY_S = (0.2, 5.0)  # first and longest wait before calling a kvcache that failed again


class TracedPagePool(PagePool):
    """A PagePool that records its prefix-index changes for publishing and traces requests' pages.
    `traceparents`: seq id -> W3C trace context of the requests that have one."""

    def __init__(self, worker_id: str, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.worker_id = worker_id
        self.index_changes = []
        self.traceparents: dict[str, str] = {}
        self.tracer = telemetry.tracer("kvmesh.scheduler")
        self._opened: dict[str, int] = {}  # traced sequences opened since `trace_opened`: prefix pages
        self._traced: set[str] = set()  # traced sequences whose kvmesh.kv.open span was sent

    def open(self, seq_id, prefix_pages):
        super().open(seq_id, prefix_pages)
        if seq_id in self.traceparents:
            self._opened[seq_id] = len(prefix_pages)

    def release(self, seq_id):
        held = len(self.tables[seq_id].page_ids) if seq_id in self.tables else 0
        super().release(seq_id)
        if self._opened.pop(seq_id, None) is None and seq_id in self._traced:
            self._traced.discard(seq_id)
            self._span("kvmesh.kv.release", seq_id, {"kvmesh.pages": held})

    def trace_opened(self) -> None:
        """Spans for the sequences admitted by the last schedule (an admission that was tried and
        undone in the same schedule leaves none)."""
        for seq_id, prefix_pages in self._opened.items():
            if seq_id in self.tables:
                self._traced.add(seq_id)
                self._span("kvmesh.kv.open", seq_id, {"kvmesh.prefix_pages": prefix_pages})
        self._opened.clear()

    def _span(self, name: str, seq_id: str, attributes: dict) -> None:
        st = self.stats()
        parent = telemetry.context_from_traceparent(self.traceparents.get(seq_id, ""))
        self.tracer.start_span(name, context=parent, attributes={
            "kvmesh.worker_id": self.worker_id, "kvmesh.request_id": seq_id, **attributes,
            "kvmesh.free_pages": st.free, "kvmesh.cached_pages": st.cached}).end()


class KVPublisher:
    """Publishes one worker's page events to kvcache (`kvcache()` returns its stub, or None while
    none is known), under the scheduler's lease `lease_token` on the worker."""

    def __init__(self, pool: TracedPagePool, worker_id: str, epoch: int, lease_token: int, kvcache,
                 tier: set[bytes] | None = None, tier_pages: int = 0):
        self.pool, self.worker_id, self.epoch, self.lease_token = pool, worker_id, epoch, lease_token
        self.tier = tier if tier is not None else set()  # the worker's tier, as it reported it
        self.tier_pages = tier_pages  # its capacity
        self.kvcache = kvcache
        self.changed = asyncio.Event()
        self.resync = True  # the first call carries the whole index (empty at the start)
        self.closing = asyncio.Event()
        self._sent_counts: tuple[int, int, int] | None = None

    def after_step(self) -> None:
        """Called on the batching loop after a step: wakes the sender when something changed."""
        if self.pool.index_changes or self._counts() != self._sent_counts:
            self.changed.set()

    def close(self) -> None:
        """The loop ended: the last call forgets the worker's index (ours, by lease token)."""
        self.closing.set()
        self.changed.set()

    def _counts(self) -> tuple[int, int, int]:
        st = self.pool.stats()
        return st.used, st.free, st.cached

    def _request(self) -> kvcache_pb2.PublishRequest:
        """What to send now: the whole index when a resync is due, else the changes since the last call."""
        used, free, cached = self._sent_counts = self._counts()
        request = kvcache_pb2.PublishRequest(
            worker_id=self.worker_id, epoch=self.epoch, num_pages=self.pool.num_pages, page_size=self.pool.page_size,
            lease_token=self.lease_token, pages=kvcache_pb2.PageCounts(used=used, free=free, cached=cached),
            tier_pages=self.tier_pages)
        changes, self.pool.index_changes = self.pool.index_changes, []
        changed = set() if self.resync else {h for _, h in changes}  # each hash once, by where it ended up
        index, tier = self.pool.index, self.tier
        if self.resync or len(changed) > self.pool.num_pages + len(tier):  # (churn while a slow call was out: send it whole)
            request.full = True
            request.stored.extend(index.keys() | tier)
        else:
            request.stored.extend(h for h in changed if h in index or h in tier)
            request.evicted.extend(h for h in changed if h not in index and h not in tier)
        return request

    async def run(self) -> None:
        retry = RETRY_S[0]
        while True:
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=retry if self.resync else None)
            except asyncio.TimeoutError:
                pass  # a resync is due: try again even if nothing changed
            self.changed.clear()
            stub = self.kvcache()
            if self.closing.is_set():
                if stub is not None:
                    forget = kvcache_pb2.PublishRequest(worker_id=self.worker_id, epoch=self.epoch, forget=True,
                                                        lease_token=self.lease_token)
                    try:
                        await stub.Publish(forget, timeout=5)
                    except grpc.aio.AioRpcError as e:
                        log.warning("kvcache forget for %s failed: %s", self.worker_id, e.code())
                return
            if stub is None:  # no kvcache known yet: the whole index goes to the first one
                self.resync = True
                self.pool.index_changes.clear()
                continue
            request = self._request()
            try:
                response = await stub.Publish(request, timeout=10)
            except grpc.aio.AioRpcError as e:
                if not self.resync:
                    log.warning("kvcache Publish for %s failed (%s): its whole index goes next", self.worker_id, e.code())
                self.resync = True
                try:  # back off (a whole index per step would be the cost of a kvcache that is down)
                    await asyncio.wait_for(self.closing.wait(), timeout=retry)
                except asyncio.TimeoutError:
                    pass
                retry = min(retry * 2, RETRY_S[1])
                continue
            self.resync = response.resync
            retry = RETRY_S[0]
            if response.resync:
                log.warning("kvcache asked for the whole prefix index of %s (it restarted): sending it", self.worker_id)
                self.changed.set()
