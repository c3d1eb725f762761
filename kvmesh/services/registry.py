"""The service registry in Redis: TTL leases that each service renews with a heartbeat.

A service writes `kvmesh:svc:<kind>:<id>` (a JSON record with its address and facts) with a TTL
and renews it every third of the TTL; a process that dies disappears when its lease expires,
so adding or removing a process needs no configuration change. Worker epochs live here too:
`kvmesh:worker:<id>:epoch` is bumped at every worker start. So do the worker leases that give
each worker one owning scheduler (`kvmesh:owner:<worker id>`, with a fencing token counter), the
leader leases, and `kvmesh:request:<id>`, which names the scheduler that holds a resumable request
(a lease its scheduler renews), for a router to attach a reconnecting client to it. This module is
the only one that builds these key strings.

Redis is a shared cache of facts whose owners are the processes themselves, so an outage is
survived: every service keeps the registry it last read, retries with backoff, and writes its
facts again when Redis answers (a restarted Redis starts empty). `Registry.settled()` says when
absences in Redis mean something again: a while after Redis came back, every live service has
re-registered and every owner has taken its leases again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Awaitable, Callable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

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


def kv_tokens(worker_records: list[dict], pool: str) -> int | None:
    """Tokens the smallest KV pool among `pool`'s registered workers holds (None: none says)."""
    sizes = [int(w["num_pages"]) * int(w.get("page_size", 16)) for w in worker_records
             if pool_of(w) == pool and w.get("num_pages")]
    return min(sizes, default=None)


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


def owner_key(worker_id: str) -> str:
    """The lease of the scheduler that owns a worker: `<scheduler id> <token>`, with a TTL."""
    return f"{PREFIX}owner:{worker_id}"


def owner_token_key(worker_id: str) -> str:
    """The worker's fencing-token counter: every new owner gets a larger token than the last."""
    return f"{PREFIX}owner-token:{worker_id}"


def epoch_key(worker_id: str) -> str:
    return f"{PREFIX}worker:{worker_id}:epoch"


# Takes a free worker lease. ARGV: holder id, ttl ms, floor (the worker's highest token seen),
# token to keep (0: a new one). A new token is above both the counter and the floor, so tokens
# stay monotonic per worker even when Redis lost its counter. Returns the token, 0 if held.
_ACQUIRE = """
if redis.call('exists', KEYS[1]) == 1 then return 0 end
local token = tonumber(ARGV[4])
local counter = tonumber(redis.call('get', KEYS[2])) or 0
if token == 0 then
  token = math.max(counter, tonumber(ARGV[3])) + 1
end
if counter < token then redis.call('set', KEYS[2], token) end
redis.call('set', KEYS[1], ARGV[1] .. ' ' .. token, 'PX', ARGV[2])
return token
"""
# Renews a lease held as ARGV[1]: 1 renewed, 0 someone else holds it, -1 absent (expired or lost).
_RENEW = """
local v = redis.call('get', KEYS[1])
if v == ARGV[1] then redis.call('pexpire', KEYS[1], ARGV[2]) return 1 end
if v then return 0 end
return -1
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


def lease_value(holder: str, token: int) -> str:
    return f"{holder} {token}"


def parse_lease(value: str | None) -> tuple[str, int] | None:
    """(holder, token) of a stored worker lease, None when absent."""
    if not value:
        return None
    holder, _, token = value.rpartition(" ")
    return holder, int(token)


class RedisOutage:
    """Whether Redis answers, as seen by one process's loops: each failure gives the delay before
    the next try (exponential, capped), only the first failure of an outage is logged, and the
    first success after one is logged and remembered (`restored_at`)."""

    def __init__(self, base_s: float = 0.2, cap_s: float = 2.0):
        self.base_s, self.cap_s = base_s, cap_s
        self.failures = 0
        self.restored_at = float("-inf")

    @property
    def down(self) -> bool:
        return self.failures > 0

    def failed(self, what: str, error: Exception) -> float:
        """Records a failed Redis call; returns how long to wait before the next."""
        if self.failures == 0:
            log.warning("Redis does not answer (%s: %s): serving from what was last read, retrying", what, error)
        self.failures += 1
        return min(self.cap_s, self.base_s * 2 ** min(self.failures - 1, 16))

    def ok(self) -> bool:
        """Records a successful call; True when it ends an outage."""
        if self.failures == 0:
            return False
        log.warning("Redis answers again after %d failed calls", self.failures)
        self.failures = 0
        self.restored_at = time.monotonic()
        return True


class Registry:
    """Registers this process and finds the others. All methods are coroutines, and raise Redis
    errors except where said; the heartbeat survives an outage and registers again after it
    (then runs the `on_restore` callbacks, which write this process's other facts again)."""

    def __init__(self, redis_url: str, lease_s: float = 6.0):
        # Timeouts: a Redis that hangs must not hang a loop that serves from its last read. One
        # retry on a broken connection: after a Redis restart every pooled connection is stale.
        self.redis = connect(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0,
                             retry=Retry(NoBackoff(), 1), retry_on_error=[aioredis.ConnectionError])
        self.lease_s = lease_s
        self.outage = RedisOutage(cap_s=lease_s / 3)
        self.on_restore: list[Callable[[], Awaitable[None]]] = []
        self.on_close: list[Callable[[], Awaitable[None]]] = []
        self._heartbeats: list[asyncio.Task] = []
        self._own: dict[str, str] = {}  # our registry keys -> their payloads

    async def register(self, kind: str, instance_id: str, record: dict) -> None:
        """Writes the lease now and keeps renewing it until `close()`."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        key = service_key(kind, instance_id)
        payload = json.dumps({"id": instance_id, "kind": kind, **record})
        await self.redis.set(key, payload, px=int(self.lease_s * 1000))
        self._own[key] = payload
        self._heartbeats.append(asyncio.create_task(self._renew(key, payload)))

    async def _renew(self, key: str, payload: str) -> None:
        delay = self.lease_s / 3
        while True:
            await asyncio.sleep(delay)
            try:
                previous = await self.redis.set(key, payload, px=int(self.lease_s * 1000), get=True)
            except Exception as e:  # Redis down: keep serving, retry with backoff
                delay = self.outage.failed(f"renewing {key}", e)
                continue
            delay = self.lease_s / 3
            if self.outage.ok() or previous is None:  # after an outage, or Redis lost our lease: restore
                await self._restored(f"registered {key} again")

    async def check_registration(self) -> bool:
        """Whether Redis still holds this process's registration (False: it lost it, e.g. it
        restarted empty; then it is written again and the restore callbacks run). Raises (and
        counts an outage) when Redis does not answer. Discovery loops call it first each round."""
        try:
            present = await self.redis.exists(*self._own) if self._own else 0
        except Exception as e:
            self.outage.failed("reading the registry", e)
            raise
        ended = self.outage.ok()
        if present == len(self._own) and not ended:
            return True
        for key, payload in self._own.items():
            await self.redis.set(key, payload, px=int(self.lease_s * 1000))
        await self._restored("registered again")
        return present == len(self._own)

    async def _restored(self, what: str) -> None:
        self.outage.restored_at = time.monotonic()
        log.warning("Redis: %s; restoring this process's state there", what)
        for restore in self.on_restore:
            try:
                await restore()
            except Exception as e:  # the next heartbeat or discovery round tries again
                log.warning("restoring state in Redis failed: %s", e)
                self.outage.failures = max(1, self.outage.failures)

    def settled(self) -> bool:
        """False while Redis is down and for one lease after it came back: absences there (a
        service, a worker's owner) may only mean their holders have not written them again yet."""
        return not self.outage.down and time.monotonic() - self.outage.restored_at >= self.lease_s

    async def deregister(self, kind: str, instance_id: str) -> None:
        self._own.pop(service_key(kind, instance_id), None)
        try:
            await self.redis.delete(service_key(kind, instance_id))
        except Exception as e:  # stopping during an outage: the lease expires by itself
            log.warning("deregistering %s %s: %s", kind, instance_id, e)

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
    async def queue_states(self) -> list[dict]:
        """Every scheduler's published queue state."""
        keys = [k async for k in self.redis.scan_iter(match=QUEUE_STATE_PATTERN, count=100)]
        return [json.loads(v) for v in await self.redis.mget(keys) if v] if keys else []

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
        return int(await self.redis.incr(epoch_key(worker_id)))

    async def keep_epoch(self, worker_id: str, epoch: int) -> None:
        """After Redis lost its data: the worker's epoch counter goes on from its live epoch, so
        the next start still gets a new one."""
        await self.redis.set(epoch_key(worker_id), epoch, nx=True)

    async def acquire_worker(self, worker_id: str, holder: str, ttl_s: float, floor: int = 0, token: int = 0) -> int:
        """Takes the worker's lease if nobody holds it: returns the fencing token (above `floor`,
        the worker's highest seen; `token` keeps one already held), 0 when another holds it."""
        return int(await self.redis.eval(_ACQUIRE, 2, owner_key(worker_id), owner_token_key(worker_id),
                                         holder, int(ttl_s * 1000), floor, token))

    async def renew_worker(self, worker_id: str, holder: str, token: int, ttl_s: float) -> int:
        """1 renewed, 0 another scheduler holds the worker now, -1 nobody does (expired or lost)."""
        return int(await self.redis.eval(_RENEW, 1, owner_key(worker_id), lease_value(holder, token), int(ttl_s * 1000)))

    async def release_worker(self, worker_id: str, holder: str, token: int) -> None:
        await self.redis.eval(_RELEASE, 1, owner_key(worker_id), lease_value(holder, token))

    async def worker_owners(self, worker_ids: list[str]) -> dict[str, tuple[str, int]]:
        """Worker id -> (owning scheduler id, token), for the workers that have a live owner."""
        if not worker_ids:
            return {}
        values = await self.redis.mget([owner_key(w) for w in worker_ids])
        return {w: lease for w, v in zip(worker_ids, values) if (lease := parse_lease(v)) is not None}

    async def close(self) -> None:
        """Stops the heartbeats, runs the `on_close` callbacks (releasing leases), closes the client."""
        for task in self._heartbeats:
            task.cancel()
        for release in self.on_close:
            await release()
        await self.redis.aclose()
