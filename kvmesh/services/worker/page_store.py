"""What a worker knows about the content of its KV pages, its host-memory tier, and page copies.

The scheduler decides which page holds what (it owns the page accounting); the worker is the
one that holds the bytes. To let another worker read a prefix it computed, and to keep pages its
scheduler evicts, the worker keeps its own map from a full page's chained hash (the same hash as
the prefix index: kvmesh.services.kvcache.pages) to the page holding it:

- a page is registered once the step that filled it has run (its KV is written);
- when a plan hands a page out fresh (a new sequence's pages past its prefix hit, a chunk's new
  pages), whatever it held is about to be overwritten: it goes to the tier (when one is set and
  the page had a hash) and leaves the map, and the page's generation is bumped, before the step
  writes it;
- `read(hashes)` copies the leading pages it holds (pool or tier) off the compute thread; a pool
  page is read under its generation, and a page whose generation changed during the copy (handed
  out meanwhile) ends the read there, so a reader never gets a torn or reused page;
- `write(page, hash, k, v)` puts a fetched page into the pool (the scheduler reserved it: no step
  reads or writes it until the fetch is done).

The tier (`--kv-offload-mib`) is host memory, bounded, least recently used first out. What enters
and leaves it is reported to the scheduler with each step's result (`take_reports`): the worker
owns the tier, its scheduler's view of it is a cache, and kvcache's index counts a page held by a
worker while it is in its pool or its tier.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from kvmesh.services.kvcache.pages import page_hash


class PageStore:
    def __init__(self, k: torch.Tensor, v: torch.Tensor, page_size: int, tier_bytes: int = 0):
        self.k, self.v = k, v  # the pool: [layers, num_pages * page_size, kv_heads, head_dim]
        self.page_size = page_size
        layers, _, kv_heads, dim = k.shape
        self.page_bytes = 2 * layers * page_size * kv_heads * dim * k.element_size()
        self.tier_capacity = tier_bytes // self.page_bytes if tier_bytes > 0 else 0  # in pages
        self.lock = threading.Lock()
        self.page_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.generation: dict[int, int] = {}
        self.tier: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.tier_stored: list[bytes] = []
        self.tier_evicted: list[bytes] = []
        self.pages_read = {"pool": 0, "tier": 0}

    # -- the compute thread, as plans are applied and steps run ----------------------------------

    def hand_out(self, pages) -> None:
        """These pages are about to be overwritten: offload what they held, forget it."""
        with self.lock:
            for page in pages:
                h = self.hash_of.pop(page, None)
                self.generation[page] = self.generation.get(page, 0) + 1
                if h is None:
                    continue
                if self.page_of.get(h) == page:
                    del self.page_of[h]
                if self.tier_capacity:
                    self._to_tier(h, page)

    def register(self, page: int, h: bytes) -> None:
        """The page holds the full page of tokens whose chained hash is `h` (its KV is written)."""
        with self.lock:
            self.hash_of[page] = h
            self.page_of.setdefault(h, page)

    def chain(self, hashes: list[bytes], token_ids: list[int], pages: list[int], num_computed: int) -> None:
        """Registers a sequence's pages that `num_computed` tokens have filled since `hashes`
        (its chained hashes so far, extended in place)."""
        ps = self.page_size
        for i in range(len(hashes), min(num_computed // ps, len(pages))):
            hashes.append(page_hash(hashes[-1] if hashes else None, token_ids[i * ps : (i + 1) * ps]))
            self.register(pages[i], hashes[-1])

    def take_reports(self) -> tuple[list[bytes], list[bytes]]:
        """Hashes that entered and left the tier since the last call (for the step's result)."""
        with self.lock:
            stored, evicted = self.tier_stored, self.tier_evicted
            self.tier_stored, self.tier_evicted = [], []
        return stored, evicted

    def report_whole_tier(self) -> None:
        """The next report lists every page in the tier (a new scheduler starts knowing none)."""
        with self.lock:
            self.tier_stored = list(self.tier)
            self.tier_evicted = []

    @property
    def tier_bytes(self) -> int:
        return len(self.tier) * self.page_bytes

    def _to_tier(self, h: bytes, page: int) -> None:
        if h in self.tier:
            self.tier.move_to_end(h)
            return
        slots = slice(page * self.page_size, (page + 1) * self.page_size)
        self.tier[h] = (self.k[:, slots].to("cpu", copy=True), self.v[:, slots].to("cpu", copy=True))
        self.tier_stored.append(h)
        while len(self.tier) > self.tier_capacity:
            old, _ = self.tier.popitem(last=False)
            self.tier_evicted.append(old)

    # -- any thread: reads for peers and this worker's fetches, writes of fetched pages -----------

    def read(self, hashes: list[bytes]):
        """Yields (hash, k, v, from_tier) for the leading `hashes` this worker holds, in order;
        stops at the first it does not hold or that was handed out while being copied."""
        ps = self.page_size
        for h in hashes:
            with self.lock:
                page = self.page_of.get(h)
                gen = self.generation.get(page, 0) if page is not None else None
                tiered = self.tier.get(h) if page is None else None
                if tiered is not None:
                    self.tier.move_to_end(h)
            if page is not None:
                slots = slice(page * ps, (page + 1) * ps)
                k, v = self.k[:, slots].to("cpu", copy=True), self.v[:, slots].to("cpu", copy=True)
                with self.lock:
                    if self.generation.get(page, 0) != gen or self.page_of.get(h) != page:
                        return  # handed out during the copy: what was copied may be torn
                    self.pages_read["pool"] += 1
                yield h, k, v, False
            elif tiered is not None:
                with self.lock:
                    self.pages_read["tier"] += 1
                yield h, tiered[0], tiered[1], True
            else:
                return

    def write(self, page: int, h: bytes, k: torch.Tensor, v: torch.Tensor) -> None:
        """Puts a fetched page's K and V (`[layers, page_size, kv_heads, head_dim]`) into `page`."""
        self.hand_out([page])
        slots = slice(page * self.page_size, (page + 1) * self.page_size)
        self.k[:, slots].copy_(k)
        self.v[:, slots].copy_(v)
        self.register(page, h)

    def page_shape(self) -> tuple[int, ...]:
        layers, _, kv_heads, dim = self.k.shape
        return layers, self.page_size, kv_heads, dim
