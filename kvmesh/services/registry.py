"""The service registry in Redis: TTL leases that each service renews with a heartbeat.

A service writes `kvmesh:svc:<kind>:<id>` (a JSON record with its address and facts) with a TTL
and renews it every third of the TTL; a process that dies disappears when its lease expires,
so adding or removing a process needs no configuration change. Worker epochs live here too:
`kvmesh:worker:<id>:epoch` is bumped at every worker start. `kvmesh:request:<id>` names the
scheduler that holds a resumable request (a lease its scheduler renews), for a router to attach
a reconnecting client to it. This module is the only one that builds these key strings.
"""

from __future__ import annotations

import asyncio
import json
import logging

import redis.asyncio as aioredis

from kvmesh.services.redis_client import connect

log = logging.getLogger(__name__)

PREFIX = "kvmesh:"
KINDS = ("router", "scheduler", "kvcache", "worker")


def queue_state_key(scheduler_id: str) -> str:
    """Where a scheduler publishes its queue state (a JSON object per worker)."""
    return f"{PREFIX}queue:{scheduler_id}"


QUEUE_STATE_PATTERN = queue_state_key("*")


def read_queue_states(redis_client) -> list[dict]:
    """Every scheduler's published queue state, with a synchronous redis client."""
    keys = list(redis_client.scan_iter(QUEUE_STATE_PATTERN))
    return [json.loads(v) for v in redis_client.mget(keys) if v] if keys else []


def pool_of(record: dict) -> str:
    """The model pool of a scheduler's or worker's registry record (records from before pools: default)."""
    return record.get("pool", "default")


def ready_versions(worker_records: list[dict], pool: str) -> dict[str, int]:
    """Version -> registered (ready) workers of `pool`."""
    versions: dict[str, int] = {}
    for w in worker_records:
        if pool_of(w) == pool:
            versions[w.get("version", "v1")] = versions.get(w.get("version", "v1"), 0) + 1
    return versions


def service_key(kind: str, instance_id: str) -> str:
    return f"{PREFIX}svc:{kind}:{instance_id}"


def request_holder_key(request_id: str) -> str:
    """The address of the scheduler holding a resumable request (kvmesh.v1.Scheduler/Attach)."""
    return f"{PREFIX}request:{request_id}"


def rollout_key(model: str) -> str:
    """A model pool's canary rollout state (JSON of kvmesh.fleet.rollout.RolloutState)."""
    return f"{PREFIX}rollout:{model}"


def drain_key(worker_id: str) -> str:
    """Set (to the reason) when the scheduler drained a worker: `kvmesh up` replaces the process,
    and the worker itself turns NOT_SERVING and exits when it still can."""
    return f"{PREFIX}drain:{worker_id}"


DRAIN_PATTERN = drain_key("*")


class Registry:
    """Registers this process and finds the others. All methods are coroutines."""

    def __init__(self, redis_url: str, lease_s: float = 6.0):
        self.redis = connect(redis_url)
        self.lease_s = lease_s
        self._heartbeats: list[asyncio.Task] = []

    async def register(self, kind: str, instance_id: str, record: dict) -> None:
        """Writes the lease now and keeps renewing it until `close()`."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        key = service_key(kind, instance_id)
        payload = json.dumps({"id": instance_id, "kind": kind, **record})
        await self.redis.set(key, payload, px=int(self.lease_s * 1000))
        self._heartbeats.append(asyncio.create_task(self._renew(key, payload)))

    async def _renew(self, key: str, payload: str) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await self.redis.set(key, payload, px=int(self.lease_s * 1000))
            except Exception as e:  # Redis down: keep serving, retry at the next beat
                log.warning("lease renewal for %s failed: %s", key, e)

    async def deregister(self, kind: str, instance_id: str) -> None:
        await self.redis.delete(service_key(kind, instance_id))

    async def services(self, kind: str) -> list[dict]:
        """Records of the live services of one kind, sorted by id."""
        keys = [k async for k in self.redis.scan_iter(match=service_key(kind, "*"), count=100)]
        if not keys:
            return []
        values = await self.redis.mget(keys)
        return sorted((json.loads(v) for v in values if v), key=lambda r: r["id"])

    async def record(self, kind: str, instance_id: str) -> dict | None:
        """One live service's record, or None when it holds no lease."""
        value = await self.redis.get(service_key(kind, instance_id))
        return json.loads(value) if value else None

    async def hold_requests(self, request_ids, address: str, ttl_s: float) -> None:
        """Says, for `ttl_s`, that the scheduler at `address` holds these requests (one pipeline)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.set(request_holder_key(request_id), address, px=int(ttl_s * 1000))
            await pipe.execute()

    async def request_holder(self, request_id: str) -> str | None:
        """The address of the scheduler holding `request_id`, or None when none says it does."""
        return await self.redis.get(request_holder_key(request_id))

    async def rollout(self, model: str) -> dict | None:
        value = await self.redis.get(rollout_key(model))
        return json.loads(value) if value else None

    async def replace_rollout(self, model: str, expected: dict | None, new: dict) -> bool:
        """Writes `new` only if the stored state is still `expected` (None: absent); False if it changed."""
        key = rollout_key(model)
        async with self.redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(key)
                current = await pipe.get(key)
                if (json.loads(current) if current else None) != expected:
                    return False
                pipe.multi()
                pipe.set(key, json.dumps(new))
                await pipe.execute()
                return True
            except aioredis.WatchError:
                return False

    async def hold_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        """A leader lease (one holder among replicas): taken if free, renewed if ours."""
        key = f"{PREFIX}lease:{name}"
        if await self.redis.set(key, holder, nx=True, px=int(ttl_s * 1000)):
            return True
        if await self.redis.get(key) == holder:
            await self.redis.pexpire(key, int(ttl_s * 1000))
            return True
        return False

    async def mark_drained(self, worker_id: str, reason: str) -> None:
        await self.redis.set(drain_key(worker_id), reason, ex=3600)

    async def drained(self, worker_id: str) -> str | None:
        return await self.redis.get(drain_key(worker_id))

    async def clear_drained(self, worker_id: str) -> None:
        await self.redis.delete(drain_key(worker_id))

    async def next_epoch(self, worker_id: str) -> int:
        return int(await self.redis.incr(f"{PREFIX}worker:{worker_id}:epoch"))

    async def close(self) -> None:
        for task in self._heartbeats:
            task.cancel()
        await self.redis.aclose()
