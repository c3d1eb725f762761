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
from kvmesh.services.kvcache.replica import apply_ops
from kvmesh.services.registry import Registry
from kvmesh.v1 import kvcache_pb2, kvcache_pb2_grpc

log = logging.getLogger("kvmesh.kvcache")


class KVCacheService(kvcache_pb2_grpc.KVCacheServicer):
    def __init__(self):
        self.pools: dict[str, tuple[int, PagePool]] = {}  # worker id -> (epoch, pool)

    async def Apply(self, request, context):
        if request.forget:
            self.pools.pop(request.worker_id, None)
            return kvcache_pb2.ApplyResponse()
        epoch, pool = self.pools.get(request.worker_id, (None, None))
        if epoch != request.epoch:
            pool = PagePool(request.num_pages, request.page_size)
            self.pools[request.worker_id] = (request.epoch, pool)
        diverged = apply_ops(pool, request.ops)
        if diverged:
            log.error("page replica of worker %s diverged; dropping it until the next epoch", request.worker_id)
            self.pools.pop(request.worker_id)
        return kvcache_pb2.ApplyResponse(diverged=diverged)

    async def Stats(self, request, context):
        workers = []
        for worker_id, (_, pool) in sorted(self.pools.items()):
            s = pool.stats()
            workers.append(kvcache_pb2.WorkerPages(worker_id=worker_id, total_pages=s.total, free_pages=s.free,
                                                   used_pages=s.used, cached_pages=s.cached))
        return kvcache_pb2.StatsResponse(workers=workers)


async def serve(common: CommonConfig, cfg: KVCacheServiceConfig) -> None:
    service = KVCacheService()
    server = ServiceServer(["kvmesh.v1.KVCache"], lambda s: kvcache_pb2_grpc.add_KVCacheServicer_to_server(service, s),
                           common.host, cfg.port)
    await server.start()
    address = advertised_address(common, server.port)
    print(f"kvcache ready on {address}", flush=True)
    await serve_until_stopped(server, Registry(common.redis_url), "kvcache", address, {"address": address})
