"""The cluster-wide prefix index: a scheduler's pool publishes its page events, the kvcache service
keeps the index from them (over real gRPC, mirrored to a real redis-server), answers Lookup, and
rebuilds what it lost from the owner (resync) instead of guessing."""

import asyncio

import grpc
import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from kvmesh.metrics import KVCacheMetrics
from kvmesh.params import InvalidRequest
from kvmesh.services.grpc_server import ServiceServer
from kvmesh.services.kvcache.index import check_publish
from kvmesh.services.kvcache.pages import prefix_hashes
from kvmesh.services.kvcache.prefix_store import PrefixStore, prefix_key
from kvmesh.services.kvcache.server import KVCacheService
from kvmesh.services.scheduler.kv_events import KVPublisher, TracedPagePool
from kvmesh.v1 import kvcache_pb2, kvcache_pb2_grpc

CAP = 1000
H = bytes(16)


def request(**fields):
    fields = {"worker_id": "w", "epoch": 1, "num_pages": 64, "page_size": 16,
              "pages": kvcache_pb2.PageCounts(free=64), **fields}
    return kvcache_pb2.PublishRequest(**fields)


@pytest.mark.parametrize("fields, field, limit", [
    (dict(num_pages=5_000_000), "num_pages", "must be in [1, 1000] (max_pages_per_worker), got 5000000"),
    (dict(num_pages=0), "num_pages", "must be in [1, 1000]"),
    (dict(page_size=0), "page_size", "must be in [1, 65536]"),
    (dict(stored=[H] * 65), "stored", "has 65 page hashes, over the 64 pages of the pool and its tier"),
    (dict(stored=[H] * 81, tier_pages=16), "stored", "has 81 page hashes, over the 80 pages of the pool and its tier"),
    (dict(tier_pages=1001), "tier_pages", "must be at most 1000 (max_pages_per_worker), got 1001"),
    (dict(evicted=[H, b"short"]), "evicted[1]", "has 5 bytes, not a 16-byte page hash"),
    (dict(pages=kvcache_pb2.PageCounts(used=60, free=60)), "pages", "used + free + cached is 120, not the pool's 64 pages"),
])
def test_a_publish_no_scheduler_could_have_made_is_refused_naming_the_field_and_the_limit(fields, field, limit):
    with pytest.raises(InvalidRequest) as err:
        check_publish(request(**fields), CAP)
    assert err.value.field == field and limit in str(err.value)


class KVCache:
    """A kvcache service in this process, on a real gRPC port; `restart()` starts an empty one on the same port."""

    def __init__(self, redis_url):
        self.redis_url, self.port = redis_url, 0

    async def start(self):
        self.redis = aioredis.from_url(self.redis_url)
        self.service = KVCacheService(PrefixStore(self.redis), KVCacheMetrics(CollectorRegistry()))
        self.server = ServiceServer(["kvmesh.v1.KVCache"],
                                    lambda s: kvcache_pb2_grpc.add_KVCacheServicer_to_server(self.service, s),
                                    "127.0.0.1", self.port)
        self.port = self.server.port
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = kvcache_pb2_grpc.KVCacheStub(self.channel)
        return self

    async def stop(self):
        await self.channel.close()
        await self.server.server.stop(None)
        await self.redis.aclose()

    async def restart(self):
        await self.stop()
        return await self.start()

    async def lookup(self, hashes):
        return {w.worker_id: w.pages for w in (await self.stub.Lookup(kvcache_pb2.LookupRequest(hashes=hashes))).workers}


async def until(condition, timeout=30):
    deadline = asyncio.get_running_loop().time() + timeout
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.02)


def computed_pages(pool, seq_id, tokens):
    """What a step does to a pool: the sequence's pages for `tokens`, all computed and published."""
    pool.open(seq_id, pool.match_prefix(tokens))
    pool.grow(seq_id, len(tokens))
    pool.commit(seq_id, tokens, len(tokens))


def test_a_publisher_keeps_kvcache_s_index_and_rebuilds_it_after_kvcache_restarts(redis_url):
    prompt_a, prompt_b = list(range(100, 180)), list(range(300, 340))  # 5 and 2 full pages

    async def run():
        kv = await KVCache(redis_url).start()
        pool = TracedPagePool("w", 64, 16)
        publisher = KVPublisher(pool, "w", epoch=1, lease_token=3, kvcache=lambda: kv.stub)
        sender = asyncio.create_task(publisher.run())
        hashes_a, hashes_b = prefix_hashes(prompt_a + [0], 16), prefix_hashes(prompt_b + [0], 16)

        computed_pages(pool, "a", prompt_a)
        publisher.after_step()
        await until(lambda: _eq(kv.lookup(hashes_a), {"w": 5}))
        pool.release("a")  # cached now: still in the index
        computed_pages(pool, "b", prompt_b)
        publisher.after_step()
        await until(lambda: _eq(kv.lookup(hashes_b), {"w": 2}))
        [stats] = (await kv.stub.Stats(kvcache_pb2.StatsRequest())).workers
        # Every worker's room (pages no request holds), holder of the prompt looked up or not.
        unheld = await kv.stub.Lookup(kvcache_pb2.LookupRequest(hashes=prefix_hashes(list(range(900, 917)), 16)))
        mirror = await kv.redis.hgetall(prefix_key("w"))

        await kv.restart()  # an empty kvcache on the same port: the next change is answered `resync`
        assert await kv.lookup(hashes_a) == {}
        pool.release("b")
        publisher.after_step()
        await until(lambda: _eq(kv.lookup(hashes_a), {"w": 5}))
        rebuilt = await kv.lookup(hashes_b), (await kv.stub.Stats(kvcache_pb2.StatsRequest())).workers[0]

        publisher.close()
        await sender
        forgotten = await kv.lookup(hashes_a), await kv.redis.exists(prefix_key("w"))
        await kv.stop()
        return stats, unheld, mirror, rebuilt, forgotten

    stats, unheld, mirror, (lookup_b, after), (lookup_a, mirrored) = asyncio.run(run())
    assert (stats.used_pages, stats.cached_pages, stats.indexed_pages) == (3, 5, 7)  # b holds 3 pages, a's 5 cached
    assert list(unheld.workers) == [] and dict(unheld.room_pages) == {"w": 61}  # 56 free, 5 cached
    assert len(mirror) == 7 and set(mirror.values()) == {b"1"}  # field: page hash, value: the worker's epoch
    assert lookup_b == {"w": 2} and (after.used_pages, after.cached_pages, after.indexed_pages) == (0, 7, 7)
    assert lookup_a == {} and mirrored == 0  # the loop's end forgets the worker, in Redis too


async def _eq(awaitable, expected):
    return await awaitable == expected


def test_changes_from_an_owner_kvcache_does_not_know_are_not_applied_and_a_stale_owner_is_refused(redis_url):
    hashes = prefix_hashes(list(range(50)), 16)  # 3 pages

    async def run():
        kv = await KVCache(redis_url).start()
        unknown = await kv.stub.Publish(request(stored=hashes, pages=kvcache_pb2.PageCounts(used=3, free=61)))
        ignored = await kv.lookup(hashes)
        await kv.stub.Publish(request(full=True, stored=hashes, lease_token=5, pages=kvcache_pb2.PageCounts(cached=3, free=61)))
        with pytest.raises(grpc.aio.AioRpcError) as stale:
            await kv.stub.Publish(request(full=True, lease_token=4))
        await kv.stub.Publish(request(forget=True, lease_token=4))  # ignored: not the owner now
        await kv.stub.Publish(request(forget=True, lease_token=5, epoch=0))  # ignored: another epoch's
        kept = await kv.lookup(hashes)
        moved = await kv.stub.Publish(request(evicted=hashes[1:], lease_token=6))  # a new owner must send it whole
        await kv.stub.Publish(request(full=True, stored=hashes[:1], lease_token=6))
        adopted = await kv.lookup(hashes)
        await kv.stop()
        return unknown, ignored, stale.value, kept, moved, adopted

    unknown, ignored, stale, kept, moved, adopted = asyncio.run(run())
    assert unknown.resync and ignored == {}
    assert stale.code() == grpc.StatusCode.FAILED_PRECONDITION and "lease_token: 4 is stale" in stale.details()
    assert kept == {"w": 3}
    assert moved.resync and adopted == {"w": 1}
