"""Which scheduler a request goes to: the one whose worker holds the longest cached prefix of its
prompt, weighed against the work that scheduler already has (llm-d's precise prefix-cache scoring,
with the balance guard the scheduler uses among its own workers).

The router hashes the prompt's pages (the chained page hash every service uses) and asks the
kvcache service's cluster-wide prefix index how many leading pages each worker holds (`Lookup`);
discovery tells it which scheduler owns each worker (its Redis lease) and at which epoch the worker
runs, so a restarted worker's old pages never count. A scheduler's prefix is its best worker's,
or the leading pages of a prompt this router sent it that is still running there (a burst with a
new shared prefix then follows its first request before its pages are even computed). Its load is
the work this router has in flight there, in pages: prompt tokens to compute until the request's
first token arrives (its prefill is then done), plus its output tokens to come. `placement.choose_worker` then picks among schedulers as a scheduler picks among its
workers (ties go to the scheduler this router sent fewer requests, so light traffic alternates),
and the chosen scheduler places the request on the worker that holds the prefix.

With one scheduler there is nothing to choose, and no lookup is made. The lookup is a cache
query, never needed: when it fails or takes longer than LOOKUP_TIMEOUT_S the choice is made by
load and this router's own in-flight prefixes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from kvmesh.services.scheduler.placement import PlacementConfig, WorkerView, choose_worker, discount, pages_to_compute

LOOKUP_TIMEOUT_S = 0.25


@dataclass
class InFlight:
    """What this router has running on one scheduler."""

    tokens: int = 0  # prompt tokens to compute plus output tokens to come
    hashes: Counter = field(default_factory=Counter)  # page hashes of their prompts


def by_scheduler(workers: list[tuple[str, int, float]], prompt_pages: int) -> tuple[dict[str, int], dict[str, float]]:
    """Per scheduler, from kvcache's lookup of a prompt of `prompt_pages` full pages, `workers` as
    (owning scheduler, leading pages the worker holds, its room): the (leading pages, room) of the
    worker that scheduler would compute the fewest pages on, counting as placement does what a
    worker lacks and again what it lacks beyond its room; ties go to the longer prefix. (A
    scheduler's best prefix set against its roomiest worker's room, which may be another worker,
    promised a copy no worker of it had room for.)"""
    best: dict[str, tuple[tuple[float, int], int, float]] = {}
    for owner, pages, room in workers:
        key = (pages_to_compute(prompt_pages, pages, room), -pages)
        if owner not in best or key < best[owner][0]:
            best[owner] = (key, pages, room)
    return {o: pages for o, (_, pages, _) in best.items()}, {o: room for o, (_, _, room) in best.items()}


def leading(held, hashes: list[bytes]) -> int:
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


class SchedulerChoice:
    """Chooses among a pool's schedulers (by address) and counts what this router sent each."""

    def __init__(self, cfg: PlacementConfig = PlacementConfig()):
        self.cfg = cfg
        self.in_flight: dict[str, InFlight] = {}
        self.sent: Counter = Counter()  # address -> requests sent there: the tie-break

    def choose(self, addresses: list[str], hashes: list[bytes], held: dict[str, int], page_size: int,
               room: dict[str, float] | None = None) -> tuple[str, int]:
        """(address, prefix pages it holds) of the cheapest scheduler for a prompt with page
        `hashes`; from the lookup (`by_scheduler`), `held`: address -> leading pages its chosen
        worker holds, `room`: address -> that worker's pages no request holds (unknown: room enough)."""
        room = room or {}
        views = []
        for address in addresses:
            mine = self.in_flight.get(address) or InFlight()
            cached, sent = held.get(address, 0), leading(mine.hashes, hashes)
            views.append(WorkerView(address, max(cached, sent), mine.tokens / page_size, self.sent[address],
                                    max(0, sent - cached), room.get(address, float("inf"))))
        best = choose_worker(len(hashes), views, self.cfg)
        return best.worker_id, best.prefix_pages

    def start(self, address: str, hashes: list[bytes], prompt_tokens: int, output_tokens: int) -> "Routed":
        """Counts a request sent to `address`: `prompt_tokens` to compute, `output_tokens` to come."""
        mine = self.in_flight.setdefault(address, InFlight())
        self.sent[address] += 1
        mine.tokens += prompt_tokens + output_tokens
        mine.hashes.update(hashes)
        return Routed(self, address, mine, hashes, prompt_tokens, output_tokens)


@dataclass
class Routed:
    """One request's share of a scheduler's in-flight work, taken back in two parts."""

    choice: SchedulerChoice
    address: str
    mine: InFlight
    hashes: list[bytes]
    prompt_tokens: int
    output_tokens: int

    def prefilled(self) -> None:
        """Its first token arrived: its prompt is computed."""
        self.mine.tokens -= self.prompt_tokens
        self.prompt_tokens = 0

    def done(self) -> None:
        """Its stream ended."""
        mine = self.mine
        mine.tokens -= self.prompt_tokens + self.output_tokens
        self.prompt_tokens = self.output_tokens = 0
        discount(mine.hashes, self.hashes)
        self.hashes = []  # taken back once
        if not mine.tokens and not mine.hashes and self.choice.in_flight.get(self.address) is mine:
            del self.choice.in_flight[self.address]
