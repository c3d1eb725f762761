"""API keys and their per-key limits: requests per second, tokens per minute, requests in flight.

Keys come from `--api-keys K1,K2` (no limits; ids `key-1`, `key-2`, ... by position) and from
`--api-keys-file` (JSON, or TOML by its `.toml` suffix): a map from key to
`{"id": ..., "requests_per_s": ..., "tokens_per_min": ..., "max_concurrent": ...}`, each limit
optional (absent or 0: none). The file is read again when its mtime changes (and on SIGHUP); a
file that no longer parses keeps the keys before it and is logged. Only a key's id is ever shown
(metrics label, trace attribute, messages); the key itself is kept as its SHA-256 digest.

The limits are shared by every router through Redis; this module owns their keys
(`kvmesh:limits:<id>:...`):
- requests/s and tokens/min are token buckets (`TokenBucket`: full at first, refilled
  continuously, `requests_per_s` holds max(1, requests_per_s) requests, `tokens_per_min` holds a
  minute's tokens), updated atomically by one Lua script on Redis's clock. A request takes one
  request token; its prompt tokens are taken once it is tokenized (it waits for nothing: refused
  while the bucket holds fewer); its output is charged when it ends, which may leave the bucket in
  debt (down to minus a minute's tokens) that later requests wait out.
- max_concurrent is a sorted set of leases (router id + request, scored by expiry): a router
  renews its leases every LEASE_S / 3, so the slots of a router that died come back within LEASE_S.
Over a limit: `LimitExceeded`, with the seconds until the bucket allows the request (the router
answers RESOURCE_EXHAUSTED / HTTP 429 with that retry hint).

Redis unreachable: fail open, per router. Each router then limits with local buckets and a local
in-flight count of the same sizes, so the fleet admits up to (routers x limit) until Redis is back;
refusing every request because the limit store is down would turn a Redis outage into a full one.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import re
import time
import tomllib
import uuid
from dataclasses import dataclass, field, fields

from redis.exceptions import RedisError

from kvmesh.services.redis_client import connect

log = logging.getLogger("kvmesh.router")

PREFIX = "kvmesh:limits:"
LEASE_S = 15.0  # an in-flight slot outlives its router by at most this long
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
CONCURRENCY_RETRY_S = 1.0  # a slot frees when some request ends: no better estimate than "soon"


def bucket_key(key_id: str, what: str) -> str:
    """A key's token bucket (`what`: requests or tokens), a hash of level and stamp."""
    return f"{PREFIX}{key_id}:{what}"


def in_flight_key(key_id: str) -> str:
    """A key's in-flight leases: a sorted set of `router:request` members scored by expiry (ms)."""
    return f"{PREFIX}{key_id}:in_flight"


class LimitExceeded(Exception):
    """A request over one of its key's limits; `retry_after_s` is None when waiting cannot help."""

    def __init__(self, message: str, retry_after_s: float | None, limit: str):
        super().__init__(message)
        self.retry_after_s, self.limit = retry_after_s, limit


@dataclass(frozen=True)
class KeyLimits:
    """One API key's id (what metrics, traces and messages show) and its limits (0: none)."""

    id: str
    requests_per_s: float = 0.0
    tokens_per_min: int = 0
    max_concurrent: int = 0

    def __post_init__(self):
        if not isinstance(self.id, str) or not ID_PATTERN.fullmatch(self.id):
            raise ValueError(f"id must be 1 to 64 letters, digits, '.', '_' or '-' (starting with a letter or "
                             f"digit), got {self.id!r}")
        for name, kind in (("requests_per_s", (int, float)), ("tokens_per_min", (int,)), ("max_concurrent", (int,))):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kind) or not 0 <= value < math.inf:
                what = "a number" if float in kind else "an integer"
                raise ValueError(f"{name} must be {what} >= 0 (0: no limit), got {value!r}")


class KeyBook:
    """The keys a router accepts: `find(key)` gives a key's limits (None: not a key). Built from
    `--api-keys` and the keys file; `reload()` reads the file again when it changed."""

    def __init__(self, plain_keys: str = "", path: str = ""):
        self.path = path
        self._plain = {_digest(k): KeyLimits(f"key-{i}") for i, k in enumerate(_split(plain_keys), 1)}
        self._mtime: float | None = None
        self._keys = dict(self._plain)
        if path:
            self.reload(raise_errors=True)

    @property
    def enabled(self) -> bool:
        """Whether callers must present a key (some key is configured)."""
        return bool(self._keys)

    def ids(self) -> list[str]:
        return sorted({limits.id for limits in self._keys.values()})

    def find(self, key: str) -> KeyLimits | None:
        return self._keys.get(_digest(key)) if key else None

    def reload(self, raise_errors: bool = False, force: bool = False) -> bool:
        """Reads the keys file if its mtime changed (or `force`); True when the keys were replaced.
        A bad file raises ValueError when `raise_errors` (at start), else is logged and ignored."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
            if mtime == self._mtime and not force:
                return False
            with open(self.path, "rb") as f:
                from_file = parse_keys(f.read(), self.path)
        except (OSError, ValueError) as e:
            if raise_errors:
                raise ValueError(f"api_keys_file {self.path}: {e}") from None
            log.error("api_keys_file %s: %s; keeping the keys read before", self.path, e)
            return False
        clash = {v.id for v in self._plain.values()} & {v.id for v in from_file.values()}
        if clash:
            error = f"api_keys_file {self.path}: id {sorted(clash)[0]!r} is also an --api-keys id"
            if raise_errors:
                raise ValueError(error)
            log.error("%s; keeping the keys read before", error)
            return False
        self._mtime, self._keys = mtime, {**self._plain, **from_file}
        log.info("api keys: %d (%d from %s)", len(self._keys), len(from_file), self.path)
        return True


def parse_keys(data: bytes, name: str) -> dict[str, KeyLimits]:
    """{sha256 digest of key: limits} from a keys file's bytes (TOML when `name` ends in .toml,
    else JSON). ValueError naming the key's id (never the key) and the field for a bad entry."""
    try:
        table = tomllib.loads(data.decode()) if name.endswith(".toml") else json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"does not parse: {e}") from None
    if not isinstance(table, dict):
        raise ValueError("must map each key to its {id, requests_per_s, tokens_per_min, max_concurrent}")
    known = {f.name for f in fields(KeyLimits)}
    keys, ids = {}, set()
    for n, (key, spec) in enumerate(table.items(), 1):
        where = f"entry {n}" + (f" (id {spec['id']!r})" if isinstance(spec, dict) and isinstance(spec.get("id"), str) else "")
        if not key.strip() or key != key.strip() or "," in key:
            raise ValueError(f"{where}: a key must be non-empty, without surrounding spaces or commas")
        if not isinstance(spec, dict):
            raise ValueError(f"{where}: must be an object with at least an id")
        if unknown := sorted(set(spec) - known):
            raise ValueError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")
        if "id" not in spec:
            raise ValueError(f"{where}: id is required")
        try:
            limits = KeyLimits(**spec)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if limits.id in ids:
            raise ValueError(f"{where}: id {limits.id!r} is used twice")
        ids.add(limits.id)
        keys[_digest(key)] = limits
    return keys


def _split(keys: str) -> list[str]:
    return [k.strip() for k in keys.split(",") if k.strip()]


def _digest(key: str) -> str:
    return hashlib.sha256(key.strip().encode()).hexdigest()


@dataclass
class TokenBucket:
    """`capacity` tokens at most, refilled at `rate` per second; starts full. The Lua script
    `_BUCKET_LUA` is this class on Redis's clock: keep the two the same."""

    rate: float
    capacity: float
    level: float | None = None
    stamp: float = 0.0

    def take(self, cost: float, need: float, now: float) -> float:
        """Takes `cost` tokens if the bucket holds `need` (need <= 0: always, leaving it in debt down
        to -capacity); returns 0.0 when taken, else the seconds until it will hold `need`."""
        level = self.capacity if self.level is None else min(self.capacity, self.level + max(0.0, now - self.stamp) * self.rate)
        self.stamp = now
        if level >= need:
            self.level = max(-self.capacity, level - cost)
            return 0.0
        self.level = level
        return (need - level) / self.rate


_BUCKET_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, capacity, cost, need = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local state = redis.call('HMGET', KEYS[1], 'level', 'stamp')
local level = capacity
if state[1] then level = math.min(capacity, tonumber(state[1]) + math.max(0, now - tonumber(state[2])) * rate) end
local wait = 0
if level >= need then level = math.max(-capacity, level - cost) else wait = (need - level) / rate end
redis.call('HSET', KEYS[1], 'level', tostring(level), 'stamp', tostring(now))
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return tostring(wait)
"""

_ACQUIRE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

_RENEW_LUA = """
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', until_ms, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""


@dataclass
class Admission:
    """A request let in under its key: holds its in-flight slot (if the key caps them) until `KeyLimiter.finish`."""

    key: KeyLimits
    slot: str = ""  # the lease member in Redis ("" none)
    local_slot: bool = False  # a slot of the local count, taken while Redis was unreachable
    output_tokens: int = 0  # charged at `KeyLimiter.finish`
    finished: bool = field(default=False, repr=False)


class KeyLimiter:
    """The limits of `KeyLimits`, shared through Redis at `redis_url` (see the module docstring,
    also for what happens while Redis is unreachable)."""

    def __init__(self, redis_url: str, router_id: str = "", lease_s: float = LEASE_S):
        # Short timeouts: a limit check must not stall a request for longer than a refusal would.
        self.redis = connect(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self.router_id = router_id or uuid.uuid4().hex[:12]
        self.lease_s = lease_s
        self._bucket = self.redis.register_script(_BUCKET_LUA)
        self._acquire = self.redis.register_script(_ACQUIRE_LUA)
        self._renew = self.redis.register_script(_RENEW_LUA)
        self._slots: dict[str, set[str]] = {}  # in-flight key -> this router's lease members
        self._local_buckets: dict[tuple[str, str], TokenBucket] = {}
        self._local_in_flight: dict[str, int] = {}
        self._redis_down = False

    async def admit(self, key: KeyLimits) -> Admission:
        """Takes a request token and an in-flight slot; LimitExceeded when either is over."""
        if key.requests_per_s:
            wait = await self._take(key, "requests", key.requests_per_s, max(1.0, key.requests_per_s), 1, 1)
            if wait:
                raise LimitExceeded(f"API key {key.id!r} is over its limit of {key.requests_per_s:g} requests/s; "
                                    f"retry in {wait:.2f} s", wait, "requests_per_s")
        admission = Admission(key)
        if key.max_concurrent and not await self._acquire_slot(admission):
            raise LimitExceeded(f"API key {key.id!r} has {key.max_concurrent} requests in flight, its limit "
                                f"(max_concurrent)", CONCURRENCY_RETRY_S, "max_concurrent")
        return admission

    async def take_prompt(self, key: KeyLimits, tokens: int) -> None:
        """Takes a prompt's tokens from the key's tokens/min bucket; LimitExceeded when it holds fewer."""
        if not key.tokens_per_min:
            return
        if tokens > key.tokens_per_min:
            raise LimitExceeded(f"the prompt has {tokens} tokens, over API key {key.id!r}'s limit of "
                                f"{key.tokens_per_min} tokens/min", None, "tokens_per_min")
        wait = await self._take(key, "tokens", key.tokens_per_min / 60, key.tokens_per_min, tokens, tokens)
        if wait:
            raise LimitExceeded(f"API key {key.id!r} is over its limit of {key.tokens_per_min} tokens/min; "
                                f"retry in {wait:.1f} s", wait, "tokens_per_min")

    async def finish(self, admission: Admission) -> None:
        """Charges its output tokens and frees its slot; once per admission, never raises."""
        if admission.finished:
            return
        admission.finished = True
        key, output_tokens = admission.key, admission.output_tokens
        try:
            if key.tokens_per_min and output_tokens:
                await self._take(key, "tokens", key.tokens_per_min / 60, key.tokens_per_min, output_tokens, 0)
            if admission.local_slot:
                self._local_in_flight[key.id] -= 1
            elif admission.slot:
                self._slots.get(in_flight_key(key.id), set()).discard(admission.slot)
                await self.redis.zrem(in_flight_key(key.id), admission.slot)
        except (RedisError, OSError) as e:  # Redis went away meanwhile: the lease expires on its own
            log.warning("API key %s: ending a request's limits: %s", key.id, e)

    async def renew_leases(self) -> None:
        """Every lease_s / 3: extends the leases of this router's requests in flight."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            for key, members in list(self._slots.items()):
                if members:
                    try:
                        await self._renew(keys=[key], args=[int(self.lease_s * 1000), *members])
                    except (RedisError, OSError) as e:
                        self._note_redis_down(e)

    async def close(self) -> None:
        await self.redis.aclose()

    async def _take(self, key: KeyLimits, what: str, rate: float, capacity: float, cost: float, need: float) -> float:
        ttl_ms = int((2 * capacity / rate + 1) * 1000)  # past this an absent bucket (full) is the same
        try:
            wait = float(await self._bucket(keys=[bucket_key(key.id, what)], args=[rate, capacity, cost, need, ttl_ms]))
            self._note_redis_up()
            return wait
        except (RedisError, OSError) as e:
            self._note_redis_down(e)
            bucket = self._local_buckets.setdefault((key.id, what), TokenBucket(rate, capacity))
            bucket.rate, bucket.capacity = rate, capacity  # the file may have changed them
            return bucket.take(cost, need, time.monotonic())

    async def _acquire_slot(self, admission: Admission) -> bool:
        key, member = admission.key, f"{self.router_id}:{uuid.uuid4().hex}"
        redis_key = in_flight_key(key.id)
        try:
            taken = await self._acquire(keys=[redis_key], args=[member, key.max_concurrent, int(self.lease_s * 1000)])
            self._note_redis_up()
        except (RedisError, OSError) as e:
            self._note_redis_down(e)
            if self._local_in_flight.get(key.id, 0) >= key.max_concurrent:
                return False
            self._local_in_flight[key.id] = self._local_in_flight.get(key.id, 0) + 1
            admission.local_slot = True
            return True
        if taken:
            admission.slot = member
            self._slots.setdefault(redis_key, set()).add(member)
        return bool(taken)

    def _note_redis_down(self, error: Exception) -> None:
        if not self._redis_down:
            log.error("API key limits: Redis is unreachable (%s); limiting per router until it is back", error)
            self._redis_down = True

    def _note_redis_up(self) -> None:
        if self._redis_down:
            log.warning("API key limits: Redis is back; limits are shared by the routers again")
            self._redis_down = False
