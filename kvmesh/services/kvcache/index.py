"""The cluster-wide prefix index: which worker holds which page, from its scheduler's page events.

Each scheduler is the authority for the pages of the workers it owns: it decides every page on
the per-step path (kvmesh.services.kvcache.pages.PagePool) and, after its steps, publishes the
page hashes that entered and left each worker's prefix index (`PublishRequest`). The kvcache
service keeps one `WorkerIndex` per worker from those events, answers `Lookup` from it and
mirrors it to Redis. Nothing here decides a page: an index that kvcache lost (its restart, a
call that failed) is asked for again whole (`resync`), never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.params import InvalidRequest
from kvmesh.v1 import kvcache_pb2

HASH_BYTES = 16  # blake2b digest of pages.page_hash
MAX_PAGE_SIZE = 65536
MAX_LOOKUP_PAGES = 1 << 16  # a million-token prompt in 16-token pages


@dataclass
class WorkerIndex:
    """kvcache's copy of one worker's prefix index at one epoch, as its owner (`lease_token`) published it."""

    epoch: int
    lease_token: int
    num_pages: int
    page_size: int
    hashes: set[bytes] = field(default_factory=set)
    pages: kvcache_pb2.PageCounts = field(default_factory=kvcache_pb2.PageCounts)

    def apply(self, stored, evicted) -> list[tuple[bool, bytes]]:
        """Takes one call's changes; returns them as (added, hash) for the Redis mirror."""
        self.hashes.difference_update(evicted)
        self.hashes.update(stored)
        return [(False, h) for h in evicted] + [(True, h) for h in stored]

    def leading(self, hashes) -> int:
        """How many leading pages of a prompt's chained `hashes` this worker holds."""
        n = 0
        for h in hashes:
            if h not in self.hashes:
                break
            n += 1
        return n


def check_publish(request: kvcache_pb2.PublishRequest, max_pages: int) -> None:
    """Raises InvalidRequest (naming the field and the limit) for a call no scheduler could have
    made, before anything is applied or allocated: a pool (or tier) over `max_pages` pages, more
    hashes than the pool and its tier hold, a hash of the wrong size, page counts that do not add
    up to the pool."""
    if not 1 <= request.num_pages <= max_pages:
        raise InvalidRequest("num_pages", f"must be in [1, {max_pages}] (max_pages_per_worker), got {request.num_pages}")
    if request.tier_pages > max_pages:
        raise InvalidRequest("tier_pages", f"must be at most {max_pages} (max_pages_per_worker), got {request.tier_pages}")
    held = request.num_pages + request.tier_pages
    if not 1 <= request.page_size <= MAX_PAGE_SIZE:
        raise InvalidRequest("page_size", f"must be in [1, {MAX_PAGE_SIZE}], got {request.page_size}")
    for name in ("stored", "evicted"):
        hashes = getattr(request, name)
        if len(hashes) > held:
            raise InvalidRequest(name, f"has {len(hashes)} page hashes, over the {held} pages of the pool and its tier")
        bad = next((i for i, h in enumerate(hashes) if len(h) != HASH_BYTES), None)
        if bad is not None:
            raise InvalidRequest(f"{name}[{bad}]", f"has {len(hashes[bad])} bytes, not a {HASH_BYTES}-byte page hash")
    p = request.pages
    if p.used + p.free + p.cached != request.num_pages:
        raise InvalidRequest("pages", f"used + free + cached is {p.used + p.free + p.cached}, not the pool's {request.num_pages} pages")


def check_lookup(request: kvcache_pb2.LookupRequest) -> None:
    if len(request.hashes) > MAX_LOOKUP_PAGES:
        raise InvalidRequest("hashes", f"has {len(request.hashes)} page hashes, over the limit of {MAX_LOOKUP_PAGES}")
