"""Which worker a new request goes to: KV-aware cost with a balance guard.

cost(worker) = prefill_weight * (prompt pages the worker would still have to prefill, plus those
                                 of them it has no room for: see below)
             + load_weight * (the worker's load, in pages of work: tokens still to compute or
                              generate for its queued and running requests / page size)
A worker "holds" a prompt page when the page is in its prefix index or belongs to a prompt
already queued there (so a burst of requests with a new shared prefix follows the first one).
Balance guard: only workers whose load is within max(balance_slack_pages, balance_ratio *
lowest load) of the least loaded worker are candidates, so one hot prefix (a shared system
prompt) cannot pile every request on one worker while the others idle. For the guard:
- a worker's load leaves out the prompt pages this request shares that are still queued there (a
  prompt arrived just before it, not computed yet): that prefill is work the request needs
  wherever it goes, so a burst of requests with a new system prompt stays with the worker
  computing it instead of computing it again on every worker it would spill to;
- a worker's load counts the prompt pages it lacks and has no room for. A worker takes the pages
  of the prompt it lacks (fetched from the holder, or computed) into pages no request holds: free
  ones, or cached ones nobody references, which it evicts (`room_pages`). Pages beyond those come
  from its running requests (preemptions, and the prefixes it holds evicted and computed again:
  a pool with room for two system prompts beside its requests thrashes holding three).
So a hot cached prefix spreads to workers with room for it once its holder is past the slack,
and to a worker without room only once the holder is further ahead by what that worker lacks
room for; the cost counts those pages too, as pages to compute. Ties go to the worker holding
fewer pages, then by id.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

POLICIES = ("kv", "round-robin")


@dataclass(frozen=True)
class PlacementConfig:
    policy: str = "kv"
    prefill_weight: float = 1.0
    load_weight: float = 0.05
    balance_ratio: float = 0.5
    balance_slack_pages: float = 32.0

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"worker_choice must be one of {', '.join(POLICIES)}, got {self.policy!r}")


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    prefix_pages: int  # leading prompt pages the worker holds (cached or being computed)
    load_pages: float
    held_pages: int  # pages in use or cached
    queued_prefix_pages: int = 0  # of prefix_pages, those a queued prompt will compute (not cached yet)
    room_pages: float = float("inf")  # pages no request holds (free, or cached and unreferenced); inf: unknown


def short_pages(prompt_pages: int, prefix_pages: int, room_pages: float) -> float:
    """Pages of a prompt a worker holding `prefix_pages` of it lacks and has no room for."""
    return max(0.0, prompt_pages - prefix_pages - room_pages)


def pages_to_compute(prompt_pages: int, prefix_pages: int, room_pages: float) -> float:
    """The prefill a worker's cost counts: the prompt pages it lacks, and again those it has no room for."""
    return prompt_pages - prefix_pages + short_pages(prompt_pages, prefix_pages, room_pages)


def choose_worker(prompt_pages: int, views: list[WorkerView], cfg: PlacementConfig) -> WorkerView:
    """The cheapest eligible worker for a prompt of `prompt_pages` full pages; `views` non-empty."""
    def short(v: WorkerView) -> float:  # pages of the prompt it lacks and has no room for
        return short_pages(prompt_pages, v.prefix_pages, v.room_pages)

    def load(v: WorkerView) -> float:
        return v.load_pages - v.queued_prefix_pages + short(v)

    lowest = min(load(v) for v in views)
    limit = lowest + max(cfg.balance_slack_pages, cfg.balance_ratio * lowest)
    eligible = [v for v in views if load(v) <= limit]

    def cost(v: WorkerView):
        prefill = cfg.prefill_weight * pages_to_compute(prompt_pages, v.prefix_pages, v.room_pages)
        return (prefill + cfg.load_weight * v.load_pages, v.held_pages, v.worker_id)

    return min(eligible, key=cost)


def discount(queued: Counter, hashes: list[bytes]) -> None:
    """Takes one count of each of `hashes` (a prompt whose request ended) off `queued`, dropping
    those at zero: O(the prompt's pages), where `queued -= Counter(hashes)` walks every queued
    prompt's entries (O(n) per request, O(n^2) over a burst)."""
    for h in hashes:
        if (left := queued[h] - 1) > 0:
            queued[h] = left
        else:
            queued.pop(h, None)
