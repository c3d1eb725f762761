"""Which workers this scheduler drives: one owning scheduler per worker, by a lease in Redis.

A pool may have several schedulers. Each worker is owned by exactly one of them, the holder of
the worker's lease (SET NX PX in Redis, renewed every third of its TTL). Taking a lease gives a
fencing token, larger than any before it for that worker; the scheduler sends it with its Step
stream and its page events, and the worker and kvcache refuse a lower token than they have
seen, so a scheduler that lost its lease (paused past the TTL, cut off) cannot drive the worker
or touch its accounting any more. When a scheduler dies its leases expire and the survivors adopt
its workers; when Redis is down nobody can take a lease, so every owner goes on driving its
workers and takes its leases again when Redis answers.

The policy (`may_adopt`) is pure; `WorkerLeases` is its adapter to the registry.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from kvmesh.services.registry import Registry

log = logging.getLogger("kvmesh.scheduler")


def may_adopt(owned: int, workers: int, schedulers: int, free_for_s: float, grace_s: float) -> bool:
    """Whether to take a free worker now: at once while this scheduler owns less than its share of
    the pool's `workers` (so schedulers that start together split them), beyond it only once the
    worker stayed free for `grace_s` (its owner is dead and nobody under its share took it)."""
    share = -(-workers // max(1, schedulers))
    return owned < share or free_for_s >= grace_s


class WorkerLeases:
    """The worker leases this scheduler (`holder`, its registry id) holds: worker id -> token."""

    def __init__(self, registry: Registry, holder: str, ttl_s: float):
        self.registry, self.holder, self.ttl_s = registry, holder, ttl_s
        self.tokens: dict[str, int] = {}

    def holds(self, worker_id: str) -> bool:
        return worker_id in self.tokens

    async def claim(self, worker_id: str, lease: tuple[str, int] | None, floor: int) -> int:
        """Takes the worker (its current `lease`, None when free): returns our token, 0 when another
        scheduler holds it. A lease under our own id (an earlier process of this scheduler, on the same
        address) is taken over with its token; `floor` is the highest token the worker has accepted."""
        if lease is not None and lease[0] != self.holder:
            return 0
        if lease is not None:
            token = lease[1] if await self.registry.renew_worker(worker_id, self.holder, lease[1], self.ttl_s) == 1 else 0
        else:
            token = await self.registry.acquire_worker(worker_id, self.holder, self.ttl_s, floor=floor)
        if token:
            self.tokens[worker_id] = token
        return token

    def forget(self, worker_id: str) -> None:
        """Stops renewing a worker that left the registry for good (its lease then expires)."""
        self.tokens.pop(worker_id, None)

    async def keep(self, on_lost: Callable[[str], None]) -> None:
        """Renews every lease each third of the TTL; a lease found in another scheduler's hands is
        dropped and `on_lost(worker_id)` stops driving the worker. An expired or lost lease (Redis
        was down, or came back empty) is taken again with the same token if still free. While Redis
        does not answer, nothing is dropped: nobody else can take a lease then."""
        outage = self.registry.outage
        while True:
            delay = self.ttl_s / 3
            try:
                for worker_id, token in list(self.tokens.items()):
                    held = await self.registry.renew_worker(worker_id, self.holder, token, self.ttl_s)
                    if held == -1:
                        held = int(await self.registry.acquire_worker(worker_id, self.holder, self.ttl_s, token=token) > 0)
                    if held == 0 and self.tokens.get(worker_id) == token:
                        del self.tokens[worker_id]
                        log.error("lost the lease on worker %s to another scheduler: no longer driving it", worker_id)
                        on_lost(worker_id)
            except Exception as e:
                delay = min(delay, outage.failed("renewing worker leases", e))
            await asyncio.sleep(delay)

    async def release_all(self) -> None:
        """On a clean stop: frees every lease at once, so the other schedulers adopt without waiting."""
        for worker_id, token in list(self.tokens.items()):
            try:
                await self.registry.release_worker(worker_id, self.holder, token)
            except Exception as e:
                log.warning("releasing the lease on worker %s: %s", worker_id, e)
        self.tokens.clear()
