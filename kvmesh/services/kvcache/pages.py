"""Page accounting for one worker's KV pool: page tables, reference counts and the prefix index.

Every page is in exactly one state: free (no owner, no content worth keeping), in use (one or
more sequences reference it), or cached (no owner, but it holds a full page of tokens whose
chained hash is in the prefix index, so a later request with the same prefix can reuse it).
Cached pages are evicted least-recently-used, and only when no free page is left.
Invariant, checked by `check()`: free + in use + cached == total.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass, field


def page_hash(parent: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """hash(page i) = H(hash(page i-1), token ids of page i); stable across processes and hosts."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def prefix_hashes(token_ids: list[int], page_size: int) -> list[bytes]:
    """The chained hashes of the full pages of `token_ids` that a prefix hit may cover (the last
    token is always computed, so a page ending on it is left out)."""
    hashes, parent = [], None
    for i in range((len(token_ids) - 1) // page_size):
        parent = page_hash(parent, token_ids[i * page_size : (i + 1) * page_size])
        hashes.append(parent)
    return hashes


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


class PagePool:
    """Page tables and prefix sharing for `num_pages` pages of `page_size` tokens."""

    def __init__(self, num_pages: int, page_size: int = 16, enable_prefix_caching: bool = True):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages} and {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_pages
        self.hash_of: list[bytes | None] = [None] * num_pages
        self.free: set[int] = set(range(num_pages))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached pages, least recently used first
        self.index: dict[bytes, int] = {}  # page hash -> page id
        self.tables: dict[str, PageTable] = {}
        # (added, hash) for every prefix-index change, when someone mirrors the index (kvcache -> Redis).
        self.index_changes: list[tuple[bool, bytes]] | None = None

    # -- queries -------------------------------------------------------------------------------

    @property
    def num_available(self) -> int:
        """Pages an allocation can take now: free ones plus evictable cached ones."""
        return len(self.free) + len(self.evictable)

    def stats(self) -> PageStats:
        return PageStats(self.num_pages, len(self.free), self.num_pages - len(self.free) - len(self.evictable), len(self.evictable))

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def page_table(self, seq_id: str) -> list[int]:
        return self.tables[seq_id].page_ids

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Cached pages covering the longest cached prefix of `token_ids`, leaving the last token
        uncached (its logits must be computed)."""
        if not self.enable_prefix_caching:
            return []
        pages = []
        for h in prefix_hashes(token_ids, self.page_size):
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

    def commit(self, seq_id: str, token_ids: list[int], num_computed: int) -> None:
        """Publishes the sequence's pages that are now full of computed tokens to the prefix index."""
        if not self.enable_prefix_caching:
            return
        table = self.tables[seq_id]
        full = min(num_computed // self.page_size, len(table.page_ids))
        for i in range(len(table.hashes), full):
            parent = table.hashes[-1] if table.hashes else None
            h = page_hash(parent, token_ids[i * self.page_size : (i + 1) * self.page_size])
            table.hashes.append(h)
            page = table.page_ids[i]
            if h not in self.index and self.hash_of[page] is None:
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
            self.ref_count[page] -= 1
            if self.ref_count[page] == 0:
                if self.hash_of[page] is not None:
                    self.evictable[page] = None
                else:
                    self.free.add(page)

    def _roomy_free_page(self) -> int:
        pages = sorted(self.free)
        best_start, best_len, start = pages[0], 1, pages[0]
        for prev, page in zip(pages, pages[1:]):
            if page != prev + 1:
                start = page
            if page - start + 1 > best_len:
                best_start, best_len = start, page - start + 1
        return best_start + best_len // 2

    def _ref(self, page: int) -> None:
        if self.ref_count[page] == 0:
            self.evictable.pop(page, None)
        self.ref_count[page] += 1

    def _take(self, after: int | None) -> int:
        """A page for a table whose last page is `after`: the next page when it is free, so the
        table stays one contiguous run (attention then reads it in place, without a gather);
        otherwise the middle of the longest free run, leaving room to grow; otherwise the least
        recently used cached page."""
        if after is not None and after + 1 in self.free:
            page = after + 1
            self.free.remove(page)
        elif self.free:
            page = self._roomy_free_page()
            self.free.remove(page)
        else:
            page, _ = self.evictable.popitem(last=False)
            del self.index[self.hash_of[page]]
            if self.index_changes is not None:
                self.index_changes.append((False, self.hash_of[page]))
            self.hash_of[page] = None
        self.ref_count[page] = 1
        return page

    def check(self) -> None:
        """Asserts the accounting invariants (tests call it after every operation)."""
        s = self.stats()
        assert s.free + s.used + s.cached == s.total, s
        assert all(c >= 0 for c in self.ref_count), "negative reference count"
        free, evictable = self.free, set(self.evictable)
        assert not free & evictable, "a page is in two free states"
        assert all(self.ref_count[p] == 0 for p in free | evictable), "a referenced page is free"
        refs = [0] * self.num_pages
        for table in self.tables.values():
            for p in table.page_ids:
                refs[p] += 1
        assert refs == self.ref_count, "reference counts disagree with page tables"
        assert all(self.hash_of[p] == h for h, p in self.index.items()), "prefix index out of sync"
