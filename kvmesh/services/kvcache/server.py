"""The kvcache service: the authoritative page accounting of every worker, and its statistics.

`Apply` takes one step's page operations for one worker (see replica.py) and replays them;
a new epoch (the worker restarted) or `forget` (the worker is gone) drops that worker's pages.
`Stats` answers per worker: total, free, used and cached pages.
"""

from __future__ import annotations

import logging

from kvmesh.services.config import CommonConfig, KVCacheServiceConfig
from kvmesh.services.grpc_server import ServiceServer, advertised_address, serve_until_stopped
from kvmesh.services.kvcache.pages import PagePool
from kvmesh.services.kvcache.prefix_store import PrefixStore
from kvmesh.services.kvcache.replica import apply_ops
from kvmesh.services.registry import Registry
from kvmesh.v1 import kvcache_pb2, kvcache_pb2_grpc

log = logging.getLogger("kvmesh.kvcache")


class KVCacheService(kvcache_pb2_grpc.KVCacheServicer):
    """Apply: one step's page operations for one worker, replayed in order; the prefix index
    changes they cause are mirrored to Redis in one pipeline. A new epoch or `forget` drops the
    worker's pages and purges its Redis entries. Stats: pages per worker."""

    def __init__(self, store: PrefixStore):
        self.pools: dict[str, tuple[int, PagePool]] = {}  # worker id -> (epoch, pool)
        self.store = store

    async def Apply(self, request, context):
        if request.forget:
            self.pools.pop(request.worker_id, None)
            await self._mirror(request.worker_id, 0, [], purge=True)
            return kvcache_pb2.ApplyResponse()
        epoch, pool = self.pools.get(request.worker_id, (None, None))
        new_epoch = epoch != request.epoch
        if new_epoch:
            pool = PagePool(request.num_pages, request.page_size)
            pool.index_changes = []
            self.pools[request.worker_id] = (request.epoch, pool)
        diverged = apply_ops(pool, request.ops)
        changes, pool.index_changes = pool.index_changes, []
        if diverged:
            log.error("page replica of worker %s diverged; dropping it until the next epoch", request.worker_id)
            self.pools.pop(request.worker_id)
            changes, new_epoch = [], True
        await self._mirror(request.worker_id, request.epoch, changes, purge=new_epoch)
        return kvcache_pb2.ApplyResponse(diverged=diverged)

    async def _mirror(self, worker_id: str, epoch: int, changes, purge: bool) -> None:
        try:
            await self.store.apply(worker_id, epoch, changes, purge=purge)
        except Exception as e:  # Redis down: the page accounting itself is unaffected
            log.warning("prefix mirror for %s failed: %s", worker_id, e)

    async def Stats(self, request, context):
        workers = []
        for worker_id, (_, pool) in sorted(self.pools.items()):
            s = pool.stats()
            workers.append(kvcache_pb2.WorkerPages(worker_id=worker_id, total_pages=s.total, free_pages=s.free,
                                                   used_pages=s.used, cached_pages=s.cached))
        return kvcache_pb2.StatsResponse(workers=workers)


async def serve(common: CommonConfig, cfg: KVCacheServiceConfig) -> None:
    registry = Registry(common.redis_url)
    service = KVCacheService(PrefixStore(registry.redis))
    server = ServiceServer(["kvmesh.v1.KVCache"], lambda s: kvcache_pb2_grpc.add_KVCacheServicer_to_server(service, s),
                           common.host, cfg.port)
    await server.start()
    address = advertised_address(common, server.port)
    print(f"kvcache ready on {address}", flush=True)
    await serve_until_stopped(server, registry, "kvcache", address, {"address": address})
