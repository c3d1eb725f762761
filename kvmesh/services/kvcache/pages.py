"""Page accounting for one worker's KV pool: page tables, reference counts and the prefix index.

Every page is in exactly one state: free (no owner, no content worth keeping), in use (one or
more sequences reference it), or cached (no owner, but it holds a full page of tokens whose
chained hash is in the prefix index, so a later request with the same prefix can reuse it).
Cached pages are evicted least-recently-used (eviction.py), and only when no free page is left.
Invariant, checked by `check()`: free + in use + cached == total.

Every operation costs O(1) per page it touches, whatever the pool's size, and the pool's memory
grows with the pages ever handed out, not with its size: a pool of a million pages costs what a
small one costs (`FreePages` never lists the pages nobody has used yet).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass, field

from kvmesh.services.kvcache.eviction import LRUCache


def page_hash(parent: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """hash(page i) = H(hash(page i-1), token ids of page i); stable across processes and hosts."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def chained_hashes(token_ids: list[int], page_size: int, start: int = 0, parent: bytes | None = None):
    """(i, hash of page i) for the pages from `start` that a prefix hit may cover (the last token
    is always computed, so a page ending on it is left out), chained from `parent`, the hash of
    page start - 1. A generator: a caller that stops early hashes no further."""
    for i in range(start, (len(token_ids) - 1) // page_size):
        parent = page_hash(parent, token_ids[i * page_size : (i + 1) * page_size])
        yield i, parent


def prefix_hashes(token_ids: list[int], page_size: int) -> list[bytes]:
    """The chained hashes of the full pages of `token_ids` that a prefix hit may cover."""
    return [h for _, h in chained_hashes(token_ids, page_size)]


@dataclass(frozen=True)
class PageStats:
    total: int
    free: int
    used: int
    cached: int


@dataclass
class PageTable:
    """One sequence's pages in logical order, and the hashes of its leading full pages."""

    page_ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)


class FreePages:
    """The free page ids, in O(1) per operation: take a given page (to extend a run), take any
    page, give one back. Pages at or above `untouched` were never handed out and are not listed;
    pages given back wait in a queue, oldest first, and are reused before untouched ones, so the
    pages in use stay few and warm in a large pool."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.untouched = 0
        self.returned: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.returned) + self.num_pages - self.untouched

    def __contains__(self, page: int) -> bool:
        return page in self.returned or self.untouched <= page < self.num_pages

    def __iter__(self):
        yield from self.returned
        yield from range(self.untouched, self.num_pages)

    def take(self, page: int) -> None:
        """Takes `page`, which must be free and at most `untouched` (the page after one in use)."""
        if page == self.untouched:
            self.untouched += 1
        else:
            del self.returned[page]

    def take_any(self) -> int:
        if self.returned:
            page, _ = self.returned.popitem(last=False)
            return page
        self.untouched += 1
        return self.untouched - 1

    def give_back(self, page: int) -> None:
        self.returned[page] = None


class PagePool:
    """Page tables and prefix sharing for `num_pages` pages of `page_size` tokens."""

    def __init__(self, num_pages: int, page_size: int = 16, enable_prefix_caching: bool = True):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages} and {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.refs: dict[int, int] = {}  # page in use -> how many page tables hold it
        self.hash_of: dict[int, bytes] = {}  # page -> its hash, for pages in the prefix index
        self.free = FreePages(num_pages)
        self.cached = LRUCache()  # pages only the prefix index holds, least recently used first
        self.index: dict[bytes, int] = {}  # page hash -> page id
        self.tables: dict[str, PageTable] = {}
        # (added, hash) for every prefix-index change, when someone mirrors the index (kvcache -> Redis).
        self.index_changes: list[tuple[bool, bytes]] | None = None

    # -- queries -------------------------------------------------------------------------------

    @property
    def num_available(self) -> int:
        """Pages an allocation can take now: free ones plus evictable cached ones."""
        return len(self.free) + len(self.cached)

    def stats(self) -> PageStats:
        return PageStats(self.num_pages, len(self.free), len(self.refs), len(self.cached))

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def page_table(self, seq_id: str) -> list[int]:
        return self.tables[seq_id].page_ids

    def num_committed(self, seq_id: str) -> int:
        """How many leading pages of the sequence are in the prefix index already."""
        return len(self.tables[seq_id].hashes)

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Cached pages covering the longest cached prefix of `token_ids`, leaving the last token
        uncached (its logits must be computed)."""
        if not self.enable_prefix_caching:
            return []
        pages = []
        for _, h in chained_hashes(token_ids, self.page_size):
            page = self.index.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    # -- changes -------------------------------------------------------------------------------

    def open(self, seq_id: str, prefix_pages: list[int]) -> None:
        """Starts a page table that shares `prefix_pages` (from match_prefix, just before)."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already has a page table")
        table = PageTable()
        for page in prefix_pages:
            self._ref(page)
            table.page_ids.append(page)
            table.hashes.append(self.hash_of[page])
        self.tables[seq_id] = table

    def grow(self, seq_id: str, num_tokens: int) -> list[int] | None:
        """Extends the table to hold `num_tokens` tokens. Returns the new pages, or None (and
        changes nothing) when not enough pages are available."""
        table = self.tables[seq_id]
        need = self.pages_needed(num_tokens) - len(table.page_ids)
        if need <= 0:
            return []
        if need > self.num_available:
            return None
        new = []
        for _ in range(need):
            new.append(self._take(table.page_ids[-1] if table.page_ids else None))
            table.page_ids.append(new[-1])
        return new

    def commit(self, seq_id: str, token_ids, num_computed: int, first_page: int = 0) -> None:
        """Publishes the sequence's pages that are now full of computed tokens to the prefix index.
        `token_ids` holds the sequence's tokens from page `first_page` on (at least up to the last
        full page); only the pages not yet published are read, so a caller that keeps its tokens in
        one list pays per new page, not per token of context."""
        if not self.enable_prefix_caching:
            return
        table, ps = self.tables[seq_id], self.page_size
        full = min(num_computed // ps, len(table.page_ids))
        for i in range(len(table.hashes), full):
            parent = table.hashes[-1] if table.hashes else None
            at = (i - first_page) * ps
            h = page_hash(parent, token_ids[at : at + ps])
            table.hashes.append(h)
            page = table.page_ids[i]
            if h not in self.index and page not in self.hash_of:
                self.index[h] = page
                if self.index_changes is not None:
                    self.index_changes.append((True, h))
                self.hash_of[page] = h

    def adopt(self, seq_id: str, hashes: list[bytes]) -> None:
        """Publishes the sequence's first len(hashes) pages under these hashes: pages whose KV was
        written from elsewhere (fetched from a peer or a tier) rather than computed here."""
        if not self.enable_prefix_caching:
            return
        table = self.tables[seq_id]
        for page, h in zip(table.page_ids, hashes):
            if h not in self.index and page not in self.hash_of:
                self.index[h] = page
                if self.index_changes is not None:
                    self.index_changes.append((True, h))
                self.hash_of[page] = h

    def release(self, seq_id: str) -> None:
        """Drops the sequence's references; its hashed pages stay cached, the rest become free."""
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        # Last pages first into the LRU, so a prefix's head outlives its tail.
        for page in reversed(table.page_ids):
            left = self.refs[page] - 1
            if left:
                self.refs[page] = left
                continue
            del self.refs[page]
            if page in self.hash_of:
                self.cached.add(page)
            else:
                self.free.give_back(page)

    def _ref(self, page: int) -> None:
        count = self.refs.get(page, 0)
        if count == 0:
            self.cached.remove(page)
        self.refs[page] = count + 1

    def _take(self, after: int | None) -> int:
        """A page for a table whose last page is `after`: the next page when it is free, so the
        table stays one contiguous run (attention then reads it in place, without a gather);
        otherwise any free page; otherwise the least recently used cached page, emptied."""
        if after is not None and after + 1 in self.free:
            page = after + 1
            self.free.take(page)
        elif len(self.free):
            page = self.free.take_any()
        else:
            page = self.cached.evict()
            h = self.hash_of.pop(page)
            del self.index[h]
            if self.index_changes is not None:
                self.index_changes.append((False, h))
        self.refs[page] = 1
        return page

    def check(self) -> None:
        """Asserts the accounting invariants (tests call it after every operation). Costs O(pages
        ever handed out), not O(pool size)."""
        s = self.stats()
        assert s.free + s.used + s.cached == s.total, s
        assert all(c > 0 for c in self.refs.values()), "a page in use has no holder"
        returned, cached, used = set(self.free.returned), set(self.cached), set(self.refs)
        assert not (returned & cached or returned & used or cached & used), "a page is in two states"
        assert all(p < self.free.untouched for p in returned | cached | used), "an untouched page is not free"
        assert len(returned | cached | used) == self.free.untouched, "a page handed out is in no state"
        refs: dict[int, int] = {}
        for table in self.tables.values():
            for p in table.page_ids:
                refs[p] = refs.get(p, 0) + 1
        assert refs == self.refs, "reference counts disagree with page tables"
        assert all(self.hash_of.get(p) == h for h, p in self.index.items()), "prefix index out of sync"
        assert len(self.hash_of) == len(self.index), "a page has a hash the index does not list"
        assert all(p in self.hash_of for p in cached), "a cached page is not in the prefix index"
