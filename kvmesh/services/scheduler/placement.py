"""Which worker a new request goes to: KV-aware cost with a balance guard.

cost(worker) = prefill_weight * (prompt pages the worker would still have to prefill)
             + load_weight * (the worker's load, in pages of work: tokens still to compute or
                              generate for its queued and running requests / page size)
A worker "holds" a prompt page when the page is in its prefix index or belongs to a prompt
already queued there (so a burst of requests with a new shared prefix follows the first one).
Balance guard: a worker's backlog for this request is its load plus the prompt pages it would
still have to prefill (the work before the request's first token there); only workers whose
backlog is within max(balance_slack_pages, balance_ratio * lowest backlog) of the lowest are
candidates, so one hot prefix (a shared system prompt) cannot pile every request on one worker
while the others idle. The prefill counts on both sides: a less loaded worker that would have to
compute the prompt again is not idle for this request (a burst of new system prompts would
otherwise be computed on every worker its followers spill to). Ties go to the worker holding
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


def choose_worker(prompt_pages: int, views: list[WorkerView], cfg: PlacementConfig) -> WorkerView:
    """The cheapest eligible worker for a prompt of `prompt_pages` full pages; `views` non-empty."""
    def backlog(v: WorkerView) -> float:
        return v.load_pages + prompt_pages - v.prefix_pages

    lowest = min(backlog(v) for v in views)
    limit = lowest + max(cfg.balance_slack_pages, cfg.balance_ratio * lowest)
    eligible = [v for v in views if backlog(v) <= limit]

    def cost(v: WorkerView):
        prefill = cfg.prefill_weight * (prompt_pages - v.prefix_pages)
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
