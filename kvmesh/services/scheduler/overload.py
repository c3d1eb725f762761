"""Overload refused early: a request that could not start within max_queue_wait_s is refused at
Submit with a retry hint, instead of waiting in the queue and failing late.

A worker's wait for a new request is estimated the way its scheduler will serve the queue
(`start_wait_s`): every waiting request is admitted, in order, as soon as a batch slot and the
KV pages of its known tokens are free (admission's own rule); a running request frees both when
its output is done (one token per step; a request that may end on its own is expected to run as
long as recent ones did, `OutputLengths`). So the wait is the prefill still to compute ahead of
the newcomer, at the prefill rate the worker measured, plus the decode steps until its turn for
a slot and pages, at the step time the worker measured for its batch size. A burst that fits the
free slots waits for prefill only; outputs delay only those that must wait for someone to
finish. The longest a request ahead of it has waited so far is the floor of the estimate (the
queue's own sojourn time catches a machine that slowed down after it was measured). A request is
admitted while the estimate is within ADMISSION_HEADROOM of the queue-wait limit, so that a dip
in throughput to a third still lets the admitted requests start in time; a request that waits
past the limit all the same is refused then, never started, with the same hint
(RESOURCE_EXHAUSTED, not an ERROR finish).
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from dataclasses import dataclass
from typing import Callable

from kvmesh.services.scheduler.request import Request

ADMISSION_HEADROOM = 1 / 3
MIN_RETRY_S = 1.0


def _mean(values) -> float:
    return sum(values) / len(values)


class Throughput:
    """What a worker's recent steps measured: tokens per second over the last `window` steps, the
    prefill rate over the last `window` steps that prefilled (a decode-only stretch does not
    forget it), and the decode step time against batch size over the last `window` decode steps."""

    def __init__(self, window: int = 64):
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)
        self._prefill: deque[tuple[int, float]] = deque(maxlen=window)
        self._decode: deque[tuple[int, float]] = deque(maxlen=window)

    def record(self, tokens: int, seconds: float, sequences: int | None = None) -> None:
        """One step of `tokens` tokens over `sequences` sequences (called on the batching loop:
        appends, nothing more). A step with more tokens than sequences prefilled."""
        self._steps.append((tokens, seconds))
        if sequences:
            (self._prefill if tokens > sequences else self._decode).append((tokens, seconds))

    @property
    def tokens_per_s(self) -> float | None:
        return _rate(self._steps)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Tokens per second of the recent steps that prefilled; the overall rate before any did."""
        return _rate(self._prefill) or self.tokens_per_s

    def decode_step_s(self, batch: int) -> float | None:
        """Seconds of a decode step of `batch` sequences (`decode_line`)."""
        line = self.decode_line()
        return None if line is None else line[0] + line[1] * batch

    def decode_line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per sequence) of a decode step: a line fitted to the recent
        decode steps, or their mean time when their batch sizes do not tell a slope; from the
        overall rate before any decode step was measured (None before any step)."""
        if not self._decode:
            rate = self.tokens_per_s
            return (0.0, 1 / rate) if rate else None
        sizes, times = [b for b, _ in self._decode], [s for _, s in self._decode]
        mb, ms = _mean(sizes), _mean(times)
        spread = sum((b - mb) ** 2 for b in sizes)
        if spread > 0:
            slope = sum((b - mb) * (s - ms) for b, s in self._decode) / spread
            fixed = ms - slope * mb
            if slope > 0 and fixed >= 0:
                return fixed, slope
        return ms, 0.0


def _rate(steps) -> float | None:
    tokens = sum(t for t, _ in steps)
    seconds = sum(s for _, s in steps)
    return tokens / seconds if tokens and seconds > 0 else None


@dataclass(frozen=True)
class Queued:
    """A request as the wait estimate sees it: prompt tokens still to compute, output tokens
    still to come, and the KV pages admission counts for it."""

    prefill: int
    outputs: int
    pages: int

    @classmethod
    def of(cls, request: Request, computed: int, page_size: int, lengths: OutputLengths | None = None) -> "Queued":
        """`request` with `computed` of its tokens computed or expected from the cache. Its pages
        are those admission counts, for the tokens known now (its output grows them later, and
        preemption makes room then), not for max_new_tokens, which a chat request without
        max_tokens sets to the rest of the context. Its outputs to come are what is left of
        max_new_tokens, or, when it may end on its own and `lengths` are given, what recent such
        requests that came as far went on for."""
        generated = len(request.output_token_ids)
        outputs = request.stopping.max_new_tokens - generated
        if lengths is not None and not request.stopping.ignore_eos:
            outputs = lengths.remaining(generated, outputs)
        return cls(max(0, request.num_tokens - computed), outputs, -(-request.num_tokens // page_size))


class OutputLengths:
    """The output lengths of a worker's last `window` finished requests that could end on their
    own (no ignore_eos), kept sorted: what the wait estimate expects of such a request's output
    instead of its max_new_tokens."""

    MIN_SAMPLES = 8  # fewer finishes that came as far say too little: max_new_tokens is taken then

    def __init__(self, window: int = 256):
        self._recent: deque[int] = deque()
        self._sorted: list[int] = []
        self._window = window

    def record(self, length: int) -> None:
        """A finished request's output length (at a finish: O(window), off the per-token path)."""
        self._recent.append(length)
        bisect.insort(self._sorted, length)
        if len(self._recent) > self._window:
            del self._sorted[bisect.bisect_left(self._sorted, self._recent.popleft())]

    def remaining(self, generated: int, at_most: int) -> int:
        """Outputs still to come of a request that has generated `generated`: the median of the
        recorded lengths above that, less `generated` (at most `at_most`); `at_most` when fewer
        than MIN_SAMPLES recorded requests came that far."""
        first = bisect.bisect_right(self._sorted, generated)
        beyond = len(self._sorted) - first
        if beyond < self.MIN_SAMPLES:
            return at_most
        return min(at_most, self._sorted[first + beyond // 2] - generated)


class QueueWalk:
    """The queue as admission will serve it, walked request by request and kept between
    estimates: the running requests' ends (the step each ends at, the pages it frees), what is
    free after admitting the waiting requests walked so far, the decode steps that took, and their
    prefill. A newcomer's wait is read off the walk without changing it, so a queue that only
    grows at its tail (a burst of submits) is walked once, O(log n) per request, not once per
    newcomer (O(n) each, O(n^2) over a burst). Each request holds one of `slots` and its pages
    until its outputs are done (one per step), the pool has `pages`, and a step of a batch of b
    sequences takes step_s(b)."""

    def __init__(self, running: list[Queued], slots: int, pages: int, step_s: Callable[[int], float]):
        self.ends = [(r.outputs, r.pages) for r in running]
        heapq.heapify(self.ends)
        self.free_slots, self.free_pages = slots - len(running), pages - sum(r.pages for r in running)
        self.now, self.seconds = 0, 0.0  # the step the walk has reached, and the seconds of steps to it
        self.prefill = sum(r.prefill for r in running)
        self.step_s = step_s

    def _until_fits(self, pages: int) -> list[tuple[int, int]]:
        """Runs decode steps until a request of `pages` pages gets a slot and its pages (or nothing
        is left to end); returns the ends it passed."""
        passed = []
        while (self.free_slots <= 0 or self.free_pages < pages) and self.ends:
            batch = len(self.ends)
            step, freed = heapq.heappop(self.ends)
            passed.append((step, freed))
            if step > self.now:
                self.seconds += (step - self.now) * self.step_s(batch)
                self.now = step
            self.free_slots, self.free_pages = self.free_slots + 1, self.free_pages + freed
        return passed

    def admit(self, r: Queued) -> None:
        """The next waiting request, admitted as soon as it fits; it then runs for its outputs."""
        self._until_fits(r.pages)
        heapq.heappush(self.ends, (self.now + r.outputs, r.pages))
        self.free_slots, self.free_pages = self.free_slots - 1, self.free_pages - r.pages
        self.prefill += r.prefill

    def decode_s(self, newcomer_pages: int) -> float:
        """Seconds of decode steps until a newcomer of `newcomer_pages` pages, behind the walked
        requests, would start; the walk is left as it was."""
        kept = (self.free_slots, self.free_pages, self.now, self.seconds)
        passed = self._until_fits(newcomer_pages)
        seconds = self.seconds
        for end in passed:
            heapq.heappush(self.ends, end)
        self.free_slots, self.free_pages, self.now, self.seconds = kept
        return seconds

    def start_s(self, newcomer_pages: int, prefill_tokens_per_s: float) -> float:
        """Seconds until the newcomer would start: the prefill ahead of it at the prefill rate,
        plus the decode steps until its turn."""
        return self.prefill / prefill_tokens_per_s + self.decode_s(newcomer_pages)


def decode_step_s(throughput: Throughput) -> Callable[[int], float]:
    """A decode step's seconds by batch size, from the line fitted once to the measured steps (0
    before any step)."""
    fixed, per_sequence = throughput.decode_line() or (0.0, 0.0)
    return lambda batch: fixed + per_sequence * batch


def decode_wait_s(running: list[Queued], waiting: list[Queued], slots: int, pages: int, newcomer_pages: int,
                  step_s: Callable[[int], float]) -> float:
    """Seconds of decode steps until a request needing `newcomer_pages`, queued behind `waiting`
    (in admission order), gets a batch slot and its pages (`QueueWalk`)."""
    walk = QueueWalk(running, slots, pages, step_s)
    for r in waiting:
        walk.admit(r)
    return walk.decode_s(newcomer_pages)


def start_wait_s(running: list[Queued], waiting: list[Queued], slots: int, pages: int, newcomer_pages: int,
                 throughput: Throughput) -> float:
    """Seconds until a request needing `newcomer_pages` and queued now would start (0 when
    nothing is measured yet): the prefill ahead of it at the measured prefill rate, plus the
    decode steps until its turn at the measured step time of their batch (`QueueWalk`)."""
    prefill_rate = throughput.prefill_tokens_per_s
    if prefill_rate is None:
        return 0.0
    walk = QueueWalk(running, slots, pages, decode_step_s(throughput))
    for r in waiting:
        walk.admit(r)
    return walk.start_s(newcomer_pages, prefill_rate)


def estimated_wait_s(queued_tokens: int, tokens_per_s: float | None) -> float:
    """Seconds to compute `queued_tokens` at `tokens_per_s` (0 when nothing is measured yet)."""
    return queued_tokens / tokens_per_s if tokens_per_s else 0.0


def overload_retry_s(wait_s: float, max_queue_wait_s: float) -> float | None:
    """None when a request facing `wait_s` may be queued; else the seconds after which the queue
    should have drained enough to admit it (at least MIN_RETRY_S). A limit of 0 admits everything."""
    allowed = ADMISSION_HEADROOM * max_queue_wait_s
    if not max_queue_wait_s or wait_s <= allowed:
        return None
    return max(MIN_RETRY_S, wait_s - allowed)
