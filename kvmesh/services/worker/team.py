"""How many threads a CPU worker's steps run on: the team its own steps measure fastest on this
host now, found one thread at a time from every core.

A worker alone on its cores runs fastest on all of them. Beside the rest of a mesh on the same
cores (`kvmesh up`: router, scheduler and clients stream every token), a step's parallel regions
wait at their end for a thread the OS took off its core, and a small model's step is hundreds of
such regions: the cheap model of issue 13 ran its forward passes 28% slower on two threads than on
one there, and gave the cores' time to spinning (docs/benchmarks.md). Which team is faster depends
on the model and on what else runs, so it is measured, not guessed: the worker runs its current
team, and now and then a trial of windows of steps alternating another team (one thread fewer,
or every core) and the current one. Each pair of windows gives a ratio of forward seconds per
token computed; when the median ratio of a trial says the neighbour is faster by more than
`margin`, it becomes current. A first pair that shows the neighbour slower by more than `clearly`
ends the trial there (a model that needs every core pays one window of it), and trials come rarer
while the answer stays the same (from every `first_after` windows of the current team to every
`max_after`). After a trial that moved down the next one tries a thread fewer again, so a host
where the rest of the mesh keeps several cores busy is walked down to the best team one thread at
a time, each step paying `margin`; after one that did not pay, the next tries the other way, which
is back to every core at once (a thread more would differ by less than `margin` on many cores, and
the team would stay low when the cores are free again).
Only `--threads 0` (the default) tunes; a set thread count is kept.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

log = logging.getLogger("kvmesh.worker")


@dataclass
class _Window:
    seconds: float = 0.0
    tokens: int = 0
    steps: int = 0


class TeamTuner:
    """The team size for the next step (`team()`), from the steps recorded so far (`record`)."""

    def __init__(self, cores: int, window: int = 4, rounds: int = 3, margin: float = 0.1, clearly: float = 0.25,
                 first_after: int = 2, max_after: int = 512):
        if cores < 2:
            raise ValueError(f"a team tuner needs 2 or more cores, got {cores}")
        self.cores = cores
        self.current = cores
        self.direction = -1  # what the next trial tries: one thread fewer (-1) or every core (+1)
        self.other = self._neighbour()
        self.window, self.rounds, self.margin, self.clearly = window, rounds, margin, clearly
        self.first_after, self.max_after = first_after, max_after
        self.after = first_after  # windows of the current team before the next trial
        self.ran = _Window()  # steps of the current team since the last trial
        self.trial: list[_Window] | None = None  # other, current, other, current, ... while a trial runs
        self.switches = 0

    def _neighbour(self) -> int:
        """The team the next trial tries: one thread fewer or every core, as `direction` says, the
        other where that one is the current team or no team at all."""
        if (self.current == 1 and self.direction < 0) or (self.current == self.cores and self.direction > 0):
            self.direction = -self.direction
        return self.current - 1 if self.direction < 0 else self.cores

    def team(self) -> int:
        if self.trial is not None and len(self.trial) % 2 == 1:
            return self.other
        return self.current

    def record(self, tokens: int, seconds: float) -> None:
        """One step of `tokens` tokens computed in `seconds` of forward pass, on the team `team()`
        gave. A prompt token costs a fraction of what a decode row does, so one pair of windows
        may compare the steps' mix more than the teams: the median over a trial's pairs decides.
        (Counting only decode steps decided too late: under a queue most steps carry a prompt.)"""
        if tokens <= 0:
            return
        if self.trial is None:
            self.ran.steps += 1
            if self.ran.steps >= self.after * self.window:
                self.ran, self.trial = _Window(), [_Window()]
            return
        w = self.trial[-1]
        w.seconds, w.tokens, w.steps = w.seconds + seconds, w.tokens + tokens, w.steps + 1
        if w.steps < self.window:
            return
        ratios = [(o.seconds / o.tokens) / (c.seconds / c.tokens)
                  for o, c in zip(self.trial[0::2], self.trial[1::2]) if c.seconds > 0]
        if len(self.trial) == 2 and ratios and ratios[0] > 1 + self.clearly:
            self._decide(ratios[0])  # the other team is clearly slower: the trial ends at its first pair
        elif len(self.trial) < 2 * self.rounds:
            self.trial.append(_Window())
        else:
            self._decide(statistics.median(ratios) if ratios else 1.0)

    def _decide(self, ratio: float) -> None:
        """`ratio`: the other team's time per token over the current one's."""
        self.trial = None
        if ratio < 1 - self.margin:
            log.info("steps now run on %d threads: %.0f%% of the time per token on %d", self.other, 100 * ratio, self.current)
            self.current = self.other  # and the next trial goes on the same way
            self.after = self.first_after
            self.switches += 1
        else:
            self.direction = -self.direction  # the other side next
            self.after = min(self.max_after, 2 * self.after)
        self.other = self._neighbour()
