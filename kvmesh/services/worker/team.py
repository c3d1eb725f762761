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
token computed, counted only when the two windows' steps computed alike numbers of tokens (a
prompt token costs a fraction of a decode row, so windows of different mixes compare the mixes);
when the median counted ratio of a trial says the other team is faster by more than `margin`, it
becomes current. A first counted pair that shows the other team slower by more than `clearly`
ends the trial there (a model that needs every core pays one window of it), and trials come rarer
while the answer stays the same (from every `first_after` windows of the current team to every
`max_after`), and never faster than keeps such trials' windows within `share` of the forward time
past a first second (`grace_s`): a window of four long prompt steps on a thread fewer runs seconds
longer, which a served worker near saturation pays in every queued request's time to first token.

After a trial that moved down the next one tries a thread fewer again, so a host where the rest of
the mesh keeps several cores busy is walked down to the best team one thread at a time, each step
paying `margin`; after one that did not pay, the next tries the other way, which is back to every
core at once (a thread more would differ by less than `margin` on many cores, and the team would
stay low when the cores are free again).
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
                 first_after: int = 2, max_after: int = 512, alike: float = 1.5, share: float = 0.01,
                 grace_s: float = 1.0):
        if cores < 2:
            raise ValueError(f"a team tuner needs 2 or more cores, got {cores}")
        self.cores = cores
        self.current = cores
        self.direction = -1  # what the next trial tries: one thread fewer (-1) or every core (+1)
        self.other = self._neighbour()
        self.window, self.rounds, self.margin, self.clearly = window, rounds, margin, clearly
        self.alike, self.share, self.grace_s = alike, share, grace_s
        self.elapsed = 0.0  # forward seconds of every step recorded
        self.tried = 0.0  # of them, the other team's in trials that changed nothing
        self.fresh = True  # no trial has ended without a change since the start or the last change
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
        gave. A prompt token costs a fraction of what a decode row does (half, for the 125M model at
        32 rows), so a pair of windows whose steps carry different mixes compares the mixes more
        than the teams: only pairs whose windows computed alike numbers of tokens a step (within
        `alike`) count, and the median of a trial's counted pairs decides. (Counting only decode
        steps decided too late: under a queue most steps carry a prompt.)"""
        if tokens <= 0:
            return
        self.elapsed += seconds
        if self.trial is None:
            self.ran.steps += 1
            if self.ran.steps >= self.after * self.window and self._affordable():
                self.ran, self.trial = _Window(), [_Window()]
            return
        w = self.trial[-1]
        w.seconds, w.tokens, w.steps = w.seconds + seconds, w.tokens + tokens, w.steps + 1
        if w.steps < self.window:
            return
        if len(self.trial) % 2 == 1:  # the other team's window is done: the current team's comes next
            self.trial.append(_Window())
            return
        pairs = list(zip(self.trial[0::2], self.trial[1::2]))
        ratios = [(o.seconds / o.tokens) / (c.seconds / c.tokens) for o, c in pairs if self._alike(o, c)]
        if len(ratios) == 1 and ratios[0] > 1 + self.clearly and self._alike(*pairs[-1]):
            self._decide(ratios[0])  # the other team is clearly slower: the trial ends at its first counted pair
        elif len(ratios) >= self.rounds or len(pairs) >= 2 * self.rounds:
            self._decide(statistics.median(ratios) if ratios else None)
        else:
            self.trial.append(_Window())

    def _alike(self, a: _Window, b: _Window) -> bool:
        """Whether two windows' steps computed alike numbers of tokens (their mixes compare)."""
        x, y = a.tokens / a.steps, b.tokens / b.steps
        return max(x, y) <= self.alike * min(x, y) and b.seconds > 0

    def _affordable(self) -> bool:
        """Whether a trial may start: the first after the start or a change always may; after one
        that changed or decided nothing, only while the other team's windows of such trials have
        taken at most `grace_s` plus `share` of all the forward time. A heavy model under load,
        whose window of four prompt steps on a thread fewer runs seconds longer, then pays under 1%
        of its capacity; a light one, whose windows take a tenth of a second, keeps trying while
        its steps' mix settles (the cheap model's first trial meets prompt steps only, where two
        threads win, and the decode steps after them run faster on one)."""
        return self.fresh or self.tried <= self.grace_s + self.share * self.elapsed

    def _decide(self, ratio: float | None) -> None:
        """`ratio`: the other team's time per token over the current one's (None: no pair of the
        trial compared, their mixes differed: nothing is learned, and the next trial comes as
        soon as this one did, if `_affordable`)."""
        trial, self.trial = self.trial, None
        if ratio is not None and ratio < 1 - self.margin:
            log.info("steps now run on %d threads: %.0f%% of the time per token on %d", self.other, 100 * ratio, self.current)
            self.current = self.other  # and the next trial goes on the same way
            self.after = self.first_after
            self.switches += 1
            self.fresh = True
        else:
            self.fresh = False
            self.tried += sum(w.seconds for w in trial[0::2])
            if ratio is not None:
                self.direction = -self.direction  # the other side next
                self.after = min(self.max_after, 2 * self.after)
        self.other = self._neighbour()
