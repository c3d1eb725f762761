"""Worker leases and the registry's outage handling against a real redis-server: one owner per
worker, fencing tokens that only grow (even when Redis loses its data), and a registry that
notices when Redis forgot it and writes itself back."""

import asyncio
import time

import pytest

from kvmesh.services.children import free_port, redis_child, redis_answers
from kvmesh.services.registry import Registry
from kvmesh.services.scheduler.ownership import WorkerLeases, may_adopt


@pytest.fixture
def redis_server(tmp_path):
    child = redis_child(free_port(), str(tmp_path))
    deadline = time.monotonic() + 10
    while not redis_answers(child.address, 0.5):
        assert time.monotonic() < deadline, "redis-server did not start"
        time.sleep(0.05)
    yield child
    child.process.kill()
    child.process.wait()


def restart_empty(child):
    """SIGKILL and start again on the same port, with nothing in it (no persistence)."""
    child.process.kill()
    child.process.wait()
    child.start()
    deadline = time.monotonic() + 10
    while not redis_answers(child.address, 0.5):
        assert time.monotonic() < deadline, "redis-server did not come back"
        time.sleep(0.05)


def test_a_free_worker_is_taken_below_the_share_at_once_beyond_it_after_the_grace():
    assert may_adopt(owned=0, workers=2, schedulers=2, free_for_s=0.0, grace_s=1.0)
    assert not may_adopt(owned=1, workers=2, schedulers=2, free_for_s=0.5, grace_s=1.0)
    assert may_adopt(owned=1, workers=2, schedulers=2, free_for_s=1.0, grace_s=1.0)  # its owner is gone
    assert may_adopt(owned=1, workers=3, schedulers=2, free_for_s=0.0, grace_s=1.0)  # share rounds up


def test_one_owner_per_worker_and_tokens_only_grow_even_after_redis_lost_everything(redis_server):
    async def run():
        registry = Registry(f"redis://{redis_server.address}/0")
        a, b = (WorkerLeases(registry, name, ttl_s=0.5) for name in ("sched-a", "sched-b"))
        try:
            assert await a.claim("w", None, floor=0) == 1
            assert await b.claim("w", None, floor=0) == 0  # held: SET NX refuses the second
            assert await registry.worker_owners(["w", "other"]) == {"w": ("sched-a", 1)}
            assert await registry.renew_worker("w", "sched-b", 1, 0.5) == 0
            assert await registry.renew_worker("w", "sched-a", 1, 0.5) == 1
            deadline = asyncio.get_running_loop().time() + 10  # a dies: its lease expires (ttl 0.5 s)
            while await registry.worker_owners(["w"]) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            assert await registry.renew_worker("w", "sched-a", 1, 0.5) == -1
            assert await b.claim("w", None, floor=1) == 2  # adoption: a larger token
            assert await a.claim("w", ("sched-b", 2), floor=2) == 0
            # A restarted process of b (same id) takes its own lease over with its token.
            assert await WorkerLeases(registry, "sched-b", 0.5).claim("w", ("sched-b", 2), floor=2) == 2

            restart_empty(redis_server)  # counters gone: the worker's floor keeps tokens growing
            assert await registry.acquire_worker("w", "sched-a", 0.5, floor=2) == 3
            await registry.release_worker("w", "sched-a", 3)
            assert await registry.worker_owners(["w"]) == {}
        finally:
            await registry.close()

    asyncio.run(run())


def test_a_lease_lost_to_another_scheduler_stops_its_old_owner(redis_server):
    async def run():
        registry = Registry(f"redis://{redis_server.address}/0")
        a = WorkerLeases(registry, "sched-a", ttl_s=0.6)
        lost = []
        try:
            await a.claim("w", None, floor=0)
            keeper = asyncio.create_task(a.keep(lost.append))
            await registry.redis.set("kvmesh:owner:w", "sched-b 7", px=5000)  # taken over (a was cut off)
            deadline = time.monotonic() + 5
            while not lost and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            keeper.cancel()
            assert lost == ["w"] and not a.holds("w")
        finally:
            await registry.close()

    asyncio.run(run())


def test_the_registry_writes_itself_back_when_redis_comes_back_empty(redis_server):
    async def run():
        registry = Registry(f"redis://{redis_server.address}/0", lease_s=1.5)
        restored = []

        async def restore():
            restored.append(time.monotonic())

        registry.on_restore.append(restore)
        try:
            await registry.register("kvcache", "kv-1", {"address": "127.0.0.1:1"})
            assert await registry.check_registration() and registry.settled()
            redis_server.process.kill()
            redis_server.process.wait()
            with pytest.raises(Exception):
                await registry.check_registration()
            assert registry.outage.down and not registry.settled()
            restart_empty(redis_server)
            assert not await registry.check_registration()  # Redis forgot it: written back, restore ran
            assert restored and [r["id"] for r in await registry.services("kvcache")] == ["kv-1"]
            assert not registry.settled()  # absences mean nothing until every service wrote itself back
            deadline = time.monotonic() + 5
            while not registry.settled():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
        finally:
            await registry.close()

    asyncio.run(run())


def test_a_burst_of_resumable_requests_writes_each_holder_key_once_then_renews_them_all(redis_server, monkeypatch):
    """The scheduler's holder keys (`kvmesh:request:<id>` -> its address, what a router reads to
    attach a resumed stream): each new request's key is written as it arrives, alone, and every
    key is renewed each HOLD_TTL_S / 3. Before, each arrival rewrote every held key, so a burst of
    n submits made n^2 / 2 Redis writes (640 at once stalled the scheduler for seconds)."""
    import types

    from kvmesh.services.config import SchedulerServiceConfig
    from kvmesh.services.registry import request_holder_key
    from kvmesh.services.scheduler import server

    n = 60
    renewal_s = 3600.0  # first no renewal at all: only the burst's writes are counted

    async def run():
        registry = Registry(f"redis://{redis_server.address}/0")
        service = server.SchedulerService(SchedulerServiceConfig(), registry, metrics=types.SimpleNamespace())
        written = []
        write = registry.hold_requests

        async def counted(ids, address, ttl_s):
            written.extend(ids)
            await write(ids, address, ttl_s)

        monkeypatch.setattr(registry, "hold_requests", counted)
        monkeypatch.setattr(server, "HOLD_TTL_S", 3 * renewal_s)
        holder = asyncio.create_task(service.hold_requests("scheduler-a:1"))
        try:
            for i in range(n):  # as Submit does: hold it, wake the writer, wait for its key before streaming
                held = server.HeldRequest(types.SimpleNamespace(request_id=f"r{i}"), asyncio.Queue(), [], None,
                                          resumable=True, resumes=0)
                service.held[f"r{i}"] = held
                service._hold_now.set()
                await asyncio.wait_for(held.announced.wait(), 30)
            assert sorted(written) == sorted(f"r{i}" for i in range(n))  # each once
            assert [await registry.redis.get(request_holder_key(f"r{i}")) for i in range(n)] == ["scheduler-a:1"] * n
            # Renewal: a writer with a short period writes every held key again and again, in one batch each time.
            holder.cancel()
            await asyncio.gather(holder, return_exceptions=True)
            monkeypatch.setattr(server, "HOLD_TTL_S", 0.3)
            holder = asyncio.create_task(service.hold_requests("scheduler-a:1"))
            for _ in range(2):  # its first round, then a renewal
                written.clear()
                deadline = time.monotonic() + 30
                while sorted(set(written)) != sorted(f"r{i}" for i in range(n)):
                    assert time.monotonic() < deadline, "held keys were not renewed"
                    await asyncio.sleep(0.01)
        finally:
            holder.cancel()
            await asyncio.gather(holder, return_exceptions=True)
            await registry.close()

    asyncio.run(run())
