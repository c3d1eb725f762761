"""The kvcache service: the cluster-wide prefix index, fed by the schedulers' page events.

Each scheduler owns the pages of its workers and decides them on the per-step path; after its
steps it `Publish`es, per worker, the page hashes that entered and left the worker's prefix index
and the pool's page counts. This service keeps every worker's index (kvcache/index.py), answers
`Lookup` (per worker, the leading pages of a prompt it holds: what the router routes by) and
`Stats` (the counts last published), and mirrors the index to Redis. A new epoch (the worker
restarted), a new owner (a higher lease token) or `forget` (the worker is gone) starts a worker's
index over. An index it does not hold (after its own restart, or a call lost on the way) is
asked for whole (`resync`), so it is rebuilt from its owner, never guessed.

When a write to Redis fails (Redis down) the copy there is marked stale and written whole again
once Redis answers, as it is when Redis comes back empty.
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
from kvmesh.services.kvcache.index import HASH_BYTES, WorkerIndex, check_lookup, check_publish
from kvmesh.services.kvcache.prefix_store import PrefixStore
from kvmesh.services.registry import Registry
from kvmesh.services.tls import mesh_server_credentials
from kvmesh.v1 import kvcache_pb2, kvcache_pb2_grpc

log = logging.getLogger("kvmesh.kvcache")


class KVCacheService(kvcache_pb2_grpc.KVCacheServicer):
    """Publish: one scheduler's page events for one worker; the index changes are mirrored to
    Redis in one pipeline. Lookup: per worker, the leading pages of a prompt its index holds.
    Stats: per worker, the page counts its owner last published.

    Publish bounds what it takes before it keeps anything: INVALID_ARGUMENT (naming the field and
    the limit) for a pool over `max_pages_per_worker` pages, more hashes than pages, a malformed
    hash or page counts that do not add up; FAILED_PRECONDITION for a new epoch that the worker's
    registry record does not show with that page count (so an index exists only for registered
    workers), and for a lease token below the one seen for this worker and epoch (a scheduler that
    lost the worker; its `forget` is ignored)."""

    def __init__(self, store: PrefixStore, metrics: KVCacheMetrics | None = None, *, max_pages_per_worker: int = 1 << 20,
                 registered_worker: Callable[[str], Awaitable[dict | None]] | None = None):
        self.workers: dict[str, WorkerIndex] = {}
        self.tokens: dict[str, int] = {}  # worker id -> the lease token of its owner now
        self.store = store
        self.mirror_stale = False  # a write to Redis failed: the whole index is written again
        self._mirror_lock = asyncio.Lock()  # one writer at a time, so a rewrite never overtakes a change
        self.metrics = metrics or KVCacheMetrics()
        self.tracer = telemetry.tracer("kvmesh.kvcache")
        self.max_pages_per_worker = max_pages_per_worker
        self.registered_worker = registered_worker  # worker id -> its registry record (None: no check)

    async def Publish(self, request, context):
        worker_id = request.worker_id
        stale_owner = request.lease_token < self.tokens.get(worker_id, 0)
        index = self.workers.get(worker_id)
        if request.forget:
            # Only the index of the epoch it names: a loop that ended for a worker that has since
            # restarted does not drop the index its next loop (same scheduler, same token) sent.
            if not stale_owner and (index is None or index.epoch == request.epoch):
                self.workers.pop(worker_id, None)
                self.tokens.pop(worker_id, None)
                self.metrics.forget(worker_id)
                await self._mirror(worker_id, 0, [], purge=True)
            return kvcache_pb2.PublishResponse()
        try:
            check_publish(request, self.max_pages_per_worker)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if (stale := self._stale_owner(request)) is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, stale)
        current = (index is not None and index.epoch == request.epoch and index.lease_token == request.lease_token
                   and index.num_pages == request.num_pages)
        if not request.full:
            if not current:
                return kvcache_pb2.PublishResponse(resync=True)  # nothing applied: the whole index comes next
            changes = index.apply(request.stored, request.evicted)
            purge = False
        else:
            if not current and (mismatch := await self._unregistered(request)) is not None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, mismatch)
            if (stale := self._stale_owner(request)) is not None:  # a new owner's call came in meanwhile
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, stale)
            index = WorkerIndex(request.epoch, request.lease_token, request.num_pages, request.page_size)
            changes = index.apply(request.stored, ())
            self.workers[worker_id] = index
            self.tokens[worker_id] = request.lease_token
            purge = True
        index.pages.CopyFrom(request.pages)
        p = request.pages
        self.metrics.set_pages(worker_id, request.num_pages, p.used, p.free, p.cached)
        await self._mirror(worker_id, request.epoch, changes, purge=purge)
        return kvcache_pb2.PublishResponse()

    def _stale_owner(self, request) -> str | None:
        """Why the sender is not the worker's owner at this epoch (a lower lease token), or None."""
        index, token = self.workers.get(request.worker_id), self.tokens.get(request.worker_id, 0)
        if request.lease_token < token and index is not None and index.epoch == request.epoch:
            return f"lease_token: {request.lease_token} is stale, worker {request.worker_id!r} is owned with token {token}"
        return None

    async def Lookup(self, request, context):
        try:
            check_lookup(request)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        hashes = list(request.hashes)
        with self.tracer.start_as_current_span(
                "kvmesh.kv.lookup", context=telemetry.context_from_metadata(context.invocation_metadata()),
                attributes={"kvmesh.prompt_pages": len(hashes)}) as span:
            found, room = [], {}
            for worker_id, index in sorted(self.workers.items()):
                n = index.leading(hashes)
                if n:
                    found.append(kvcache_pb2.WorkerPrefix(worker_id=worker_id, pages=n, epoch=index.epoch))
                room[worker_id] = index.pages.free + index.pages.cached
            span.set_attribute("kvmesh.best_prefix_pages", max((w.pages for w in found), default=0))
        return kvcache_pb2.LookupResponse(workers=found, room_pages=room)

    async def _unregistered(self, request) -> str | None:
        """Why a new epoch's pool is not created, or None: the worker's live registry record must
        show this epoch and this many pages."""
        if self.registered_worker is None:
            return None
        try:
            record = await self.registered_worker(request.worker_id)
        except Exception as e:  # Redis down: nothing to check against; the next Publish asks again
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
            snapshot = {w: (index.epoch, list(index.hashes)) for w, index in self.workers.items()}
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
        for worker_id, index in sorted(self.workers.items()):
            p = index.pages
            workers.append(kvcache_pb2.WorkerPages(worker_id=worker_id, total_pages=index.num_pages, free_pages=p.free,
                                                   used_pages=p.used, cached_pages=p.cached,
                                                   indexed_pages=len(index.hashes)))
        return kvcache_pb2.StatsResponse(workers=workers)


async def serve(common: CommonConfig, cfg: KVCacheServiceConfig) -> None:
    telemetry.setup_tracing("kvcache")
    metrics_port = serve_metrics(common.host, cfg.metrics_port)
    registry = Registry(common.redis_url)
    service = KVCacheService(PrefixStore(registry.redis), max_pages_per_worker=cfg.max_pages_per_worker,
                             registered_worker=lambda worker_id: registry.record("worker", worker_id))
    # A whole index (a resync) is one message: up to two hashes (stored, evicted) per page, framed.
    max_message = 4 * cfg.max_pages_per_worker * (HASH_BYTES + 3) + (1 << 20)  # a pool and a tier as large, both lists
    server = ServiceServer(["kvmesh.v1.KVCache"], lambda s: kvcache_pb2_grpc.add_KVCacheServicer_to_server(service, s),
                           common.host, cfg.port, mesh_server_credentials(common), max_message_bytes=max_message)
    await server.start()
    address = advertised_address(common, server.port)

    async def mark_stale():  # Redis came back (maybe empty): write the whole index again
        service.mirror_stale = True

    registry.on_restore.append(mark_stale)
    mirror = asyncio.create_task(service.keep_mirror(registry.outage))
    print(f"kvcache ready on {address}", flush=True)
    record = {"address": address, "metrics": advertised_address(common, metrics_port) if metrics_port else ""}
    await serve_until_stopped(server, registry, "kvcache", address, record, tasks=(mirror,))
