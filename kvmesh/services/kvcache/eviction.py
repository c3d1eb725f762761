"""Which KV goes when room runs out: cached pages to evict, and running requests to preempt.

Two choices, both made here so the policy is found by its name:
- A cached page (no sequence holds it, its tokens are in the prefix index) is evicted least
  recently used first, and only when no free page is left. `LRUCache` keeps them in one ordered
  dict: adding, reusing and evicting a page are O(1) whatever the pool's size (vLLM's free-block
  queue is the model).
- A running request is preempted (its pages freed, recomputed later) when a step cannot grow the
  page tables it must: `pick_victim` picks it by policy: the newest admitted, the lowest priority
  (newest on ties), or the one holding the most KV.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol, Sequence

VICTIM_POLICIES = ("newest", "priority", "size")


class LRUCache:
    """Cached pages, least recently used first."""

    def __init__(self):
        self._pages: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, page: int) -> bool:
        return page in self._pages

    def __iter__(self):
        return iter(self._pages)

    def add(self, page: int) -> None:
        """The page's last holder let it go: it is now the most recently used cached page."""
        self._pages[page] = None

    def remove(self, page: int) -> None:
        """A sequence takes the page again (a prefix hit): it is no longer evictable."""
        self._pages.pop(page, None)

    def evict(self) -> int:
        """Takes the least recently used page out (the caller empties it)."""
        page, _ = self._pages.popitem(last=False)
        return page


class Preemptible(Protocol):
    priority: int
    num_computed_tokens: int


def pick_victim(running: Sequence[Preemptible], policy: str) -> Preemptible:
    """The running request to preempt; `running` is in admission order and not empty."""
    if policy == "priority":
        return min(reversed(running), key=lambda r: r.priority)  # lowest priority, newest on ties
    if policy == "size":
        return max(reversed(running), key=lambda r: r.num_computed_tokens)
    return running[-1]
