"""The kvcache service: the authoritative page accounting of every worker, and its statistics.

`Apply` takes one step's page operations for one worker (see replica.py) and replays them;
a new epoch (the worker restarted), a new owner (a scheduler that adopted the worker: a higher
lease token) or `forget` (the worker is gone) drops that worker's pages.
`Stats` answers per worker: total, free, used and cached pages.

The accounting here is the owner of the prefix index; Redis holds a copy for the routers. When
a write to it fails (Redis down) the copy is marked stale and written whole again once Redis
answers, as it is when Redis comes back empty.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import grpc

from kvmesh import telemetry
from kvmesh.metrics import KVCacheMetrics, serve_metrics
from kvmesh.params import InvalidRequest
from kvmesh.services.config import CommonConfig, KVCacheServiceConfig
from kvmesh.services.grpc_server import ServiceServer, advertised_address, serve_until_stopped
from kvmesh.services.kvcache.pages import PagePool
from kvmesh.services.kvcache.prefix_store import PrefixStore
from kvmesh.services.kvcache.replica import Op, apply_ops, check_apply
from kvmesh.services.registry import Registry
from kvmesh.services.tls import mesh_server_credentials
from kvmesh.v1 import kvcache_pb2, kvcache_pb2_grpc

log = logging.getLogger("kvmesh.kvcache")


class KVCacheService(kvcache_pb2_grpc.KVCacheServicer):
    """Apply: one step's page operations for one worker, replayed in order; the prefix index
    changes they cause are mirrored to Redis in one pipeline. A new epoch or `forget` drops the
    worker's pages and purges its Redis entries. Stats: pages per worker.

    Apply bounds what it takes before it allocates anything: INVALID_ARGUMENT (naming the field
    and the limit) for a pool over `max_pages_per_worker` pages, too many operations or a page
    outside the pool; FAILED_PRECONDITION for a new epoch that the worker's registry record does
    not show with that page count (so accounting exists only for registered workers), and for a
    lease token below the one seen for this worker and epoch (a scheduler that lost the worker;
    its `forget` is ignored). Operations that do not fit the pool's state count as a divergence
    (`diverged`), never as a crash."""

    def __init__(self, store: PrefixStore, metrics: KVCacheMetrics | None = None, *, max_pages_per_worker: int = 1 << 20,
                 registered_worker: Callable[[str], Awaitable[dict | None]] | None = None):
        self.pools: dict[str, tuple[int, PagePool]] = {}  # worker id -> (epoch, pool)
        self.tokens: dict[str, int] = {}  # worker id -> the lease token of its owner now
        self.store = store
        self.mirror_stale = False  # a write to Redis failed: the whole index is written again
        self._mirror_lock = asyncio.Lock()  # one writer at a time, so a rewrite never overtakes a change
        self.metrics = metrics or KVCacheMetrics()
        self.tracer = telemetry.tracer("kvmesh.kvcache")
        self.max_pages_per_worker = max_pages_per_worker
        self.registered_worker = registered_worker  # worker id -> its registry record (None: no check)

    async def Apply(self, request, context):
        stale_owner = request.lease_token < self.tokens.get(request.worker_id, 0)
        if request.forget:
            if not stale_owner:
                self.pools.pop(request.worker_id, None)
                self.tokens.pop(request.worker_id, None)
                self.metrics.forget(request.worker_id)
                await self._mirror(request.worker_id, 0, [], purge=True)
            return kvcache_pb2.ApplyResponse()
        try:
            check_apply(request, self.max_pages_per_worker)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        epoch, pool = self.pools.get(request.worker_id, (None, None))
        if stale_owner and epoch == request.epoch:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"lease_token: {request.lease_token} is stale, worker {request.worker_id!r} is owned "
                                f"with token {self.tokens[request.worker_id]}")
        new_epoch = epoch != request.epoch or request.lease_token != self.tokens.get(request.worker_id, 0)
        if not new_epoch and request.num_pages != pool.num_pages:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"num_pages: worker {request.worker_id!r} has {pool.num_pages} pages at epoch {epoch}, "
                                f"got {request.num_pages}")
        if new_epoch:
            if (mismatch := await self._unregistered(request)) is not None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, mismatch)
            pool = PagePool(request.num_pages, request.page_size)
            pool.index_changes = []
            self.pools[request.worker_id] = (request.epoch, pool)
            self.tokens[request.worker_id] = request.lease_token
        diverged = self._apply_traced(request.worker_id, pool, request.ops)
        changes, pool.index_changes = pool.index_changes, []
        if diverged:
            log.error("page replica of worker %s diverged; dropping it until the next epoch", request.worker_id)
            self.pools.pop(request.worker_id)
            changes, new_epoch = [], True
        else:
            st = pool.stats()
            self.metrics.set_pages(request.worker_id, st.total, st.used, st.free, st.cached)
        await self._mirror(request.worker_id, request.epoch, changes, purge=new_epoch)
        return kvcache_pb2.ApplyResponse(diverged=diverged)

    def _apply_traced(self, worker_id: str, pool: PagePool, ops) -> bool:
        """apply_ops, with a `kvmesh.kv.open` / `kvmesh.kv.release` span for each traced request's
        OPEN and RELEASE (its pages taken with the shared prefix, and given back)."""
        if not any(op.traceparent for op in ops):
            return apply_ops(pool, ops)
        for i, op in enumerate(ops):
            if not op.traceparent or op.kind not in (Op.OPEN, Op.RELEASE):
                if apply_ops(pool, ops[i:i + 1]):
                    return True
                continue
            table = pool.tables.get(op.seq_id)
            held = len(table.page_ids) if op.kind == Op.RELEASE and table else len(op.page_ids)
            name = "kvmesh.kv.open" if op.kind == Op.OPEN else "kvmesh.kv.release"
            attributes = {"kvmesh.worker_id": worker_id, "kvmesh.request_id": op.seq_id,
                          ("kvmesh.prefix_pages" if op.kind == Op.OPEN else "kvmesh.pages"): held}
            with self.tracer.start_as_current_span(name, context=telemetry.context_from_traceparent(op.traceparent),
                                                   attributes=attributes) as span:
                apply_ops(pool, ops[i:i + 1])
                st = pool.stats()
                span.set_attributes({"kvmesh.free_pages": st.free, "kvmesh.cached_pages": st.cached})
        return False

    async def _unregistered(self, request) -> str | None:
        """Why a new epoch's pool is not created, or None: the worker's live registry record must
        show this epoch and this many pages."""
        if self.registered_worker is None:
            return None
        try:
            record = await self.registered_worker(request.worker_id)
        except Exception as e:  # Redis down: nothing to check against; the next Apply asks again
            return f"cannot read the registry record of worker {request.worker_id!r}: {e}"
        if record is None:
            return f"worker {request.worker_id!r} is not registered"
        if record.get("epoch") != request.epoch or record.get("num_pages") != request.num_pages:
            return (f"worker {request.worker_id!r} is registered at epoch {record.get('epoch')} with "
                    f"{record.get('num_pages')} pages, not epoch {request.epoch} with {request.num_pages}")
        return None

    async def _mirror(self, worker_id: str, epoch: int, changes, purge: bool) -> None:
        if self.mirror_stale:
            return  # Redis was down: the rewrite in `keep_mirror` writes this change too
        async with self._mirror_lock:
            try:
                await self.store.apply(worker_id, epoch, changes, purge=purge)
            except Exception as e:  # Redis down: the page accounting itself is unaffected
                log.warning("prefix mirror for %s failed (%s): the index is written again once Redis answers", worker_id, e)
                self.mirror_stale = True

    async def rewrite_mirror(self) -> None:
        """Writes the whole prefix index to Redis again: every worker's entries at its epoch, and
        none for workers this service no longer accounts for. Raises Redis errors."""
        async with self._mirror_lock:
            # Changes after this snapshot wait for the lock and are written after it.
            self.mirror_stale = False
            snapshot = {w: (epoch, list(pool.index)) for w, (epoch, pool) in self.pools.items()}
            try:
                await self.store.rewrite(snapshot)
            except Exception:
                self.mirror_stale = True
                raise
        log.warning("prefix index rewritten to Redis (%d workers, %d pages)", len(snapshot),
                    sum(len(hashes) for _, hashes in snapshot.values()))

    async def keep_mirror(self, outage) -> None:
        """While the copy in Redis is stale, rewrites it, retrying with `outage`'s backoff."""
        while True:
            delay = 0.5
            if self.mirror_stale:
                try:
                    await self.rewrite_mirror()
                    outage.ok()
                except Exception as e:
                    delay = outage.failed("rewriting the prefix index", e)
            await asyncio.sleep(delay)

    async def Stats(self, request, context):
        workers = []
        for worker_id, (_, pool) in sorted(self.pools.items()):
            s = pool.stats()
            workers.append(kvcache_pb2.WorkerPages(worker_id=worker_id, total_pages=s.total, free_pages=s.free,
                                                   used_pages=s.used, cached_pages=s.cached))
        return kvcache_pb2.StatsResponse(workers=workers)


async def serve(common: CommonConfig, cfg: KVCacheServiceConfig) -> None:
    telemetry.setup_tracing("kvcache")
    metrics_port = serve_metrics(common.host, cfg.metrics_port)
    registry = Registry(common.redis_url)
    service = KVCacheService(PrefixStore(registry.redis), max_pages_per_worker=cfg.max_pages_per_worker,
                             registered_worker=lambda worker_id: registry.record("worker", worker_id))
    server = ServiceServer(["kvmesh.v1.KVCache"], lambda s: kvcache_pb2_grpc.add_KVCacheServicer_to_server(service, s),
                           common.host, cfg.port, mesh_server_credentials(common))
    await server.start()
    address = advertised_address(common, server.port)

    async def mark_stale():  # Redis came back (maybe empty): write the whole index again
        service.mirror_stale = True

    registry.on_restore.append(mark_stale)
    mirror = asyncio.create_task(service.keep_mirror(registry.outage))
    print(f"kvcache ready on {address}", flush=True)
    record = {"address": address, "metrics": advertised_address(common, metrics_port) if metrics_port else ""}
    await serve_until_stopped(server, registry, "kvcache", address, record, tasks=(mirror,))
