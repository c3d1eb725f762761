"""The Redis copy of the prefix index: which worker holds which page hash, fenced by epoch.

One Redis hash per worker, `kvmesh:prefix:<worker id>`: field = page hash (hex), value = the
worker's epoch when the page was cached. Readers count an entry only when its epoch is the
worker's live epoch (from the registry), so a restarted worker's old pages are never used;
the kvcache service deletes a worker's whole key when it sees a new epoch or the worker is
gone. Entries leave as pages are evicted, so the copy stays as small as the caches. The
kvcache service writes it once per Publish (one pipeline), never per token.
"""

from __future__ import annotations

from kvmesh.services.registry import PREFIX


def prefix_key(worker_id: str) -> str:
    return f"{PREFIX}prefix:{worker_id}"


class PrefixStore:
    def __init__(self, redis):
        self.redis = redis

    async def apply(self, worker_id: str, epoch: int, changes: list[tuple[bool, bytes]], purge: bool = False) -> None:
        """Writes one Publish's index changes (added or removed hashes) in a single round trip."""
        if not changes and not purge:
            return
        key = prefix_key(worker_id)
        pipe = self.redis.pipeline(transaction=False)
        if purge:
            pipe.delete(key)
        final = {h.hex(): is_add for is_add, h in changes}  # later changes win
        added = {h: epoch for h, is_add in final.items() if is_add}
        removed = [h for h, is_add in final.items() if not is_add]
        if removed:
            pipe.hdel(key, *removed)
        if added:
            pipe.hset(key, mapping=added)
        await pipe.execute()

    async def rewrite(self, workers: dict[str, tuple[int, list[bytes]]]) -> None:
        """Replaces the whole index with `workers` (worker id -> (epoch, its page hashes)) in one
        round trip; entries of workers not named are deleted."""
        stored = [k async for k in self.redis.scan_iter(match=prefix_key("*"), count=1000)]
        pipe = self.redis.pipeline(transaction=True)
        for key in stored:
            pipe.delete(key)
        for worker_id, (epoch, hashes) in workers.items():
            if hashes:
                pipe.hset(prefix_key(worker_id), mapping={h.hex(): epoch for h in hashes})
        await pipe.execute()

    async def purge(self, worker_id: str) -> None:
        await self.redis.delete(prefix_key(worker_id))

    async def holders(self, hashes: list[bytes], live_epochs: dict[str, int]) -> dict[str, int]:
        """For each live worker, how many leading pages of `hashes` it holds at its live epoch."""
        result = {}
        fields = [h.hex() for h in hashes]
        for worker_id, epoch in live_epochs.items():
            values = await self.redis.hmget(prefix_key(worker_id), fields) if fields else []
            n = 0
            for v in values:
                if v is None or int(v) != epoch:
                    break
                n += 1
            result[worker_id] = n
        return result
