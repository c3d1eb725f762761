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


def decode_wait_s(running: list[Queued], waiting: list[Queued], slots: int, pages: int, newcomer_pages: int,
                  step_s: Callable[[int], float]) -> float:
    """Seconds of decode steps until a request needing `newcomer_pages`, queued behind `waiting`
    (in admission order), gets a batch slot and its pages, when each request holds one of `slots`
    and its pages until its outputs are done (one per step), the pool has `pages`, and a step of
    a batch of b sequences takes step_s(b)."""
    ends = [(r.outputs, r.pages) for r in running]  # (the step it ends at, the pages it frees)
    heapq.heapify(ends)
    free_slots, free_pages = slots - len(running), pages - sum(r.pages for r in running)
    now, seconds = 0, 0.0
    for r in [*waiting, Queued(0, 0, newcomer_pages)]:
        while (free_slots <= 0 or free_pages < r.pages) and ends:
            batch = len(ends)
            step, freed = heapq.heappop(ends)
            if step > now:
                seconds += (step - now) * step_s(batch)
                now = step
            free_slots, free_pages = free_slots + 1, free_pages + freed
        heapq.heappush(ends, (now + r.outputs, r.pages))
        free_slots, free_pages = free_slots - 1, free_pages - r.pages
    return seconds


def start_wait_s(running: list[Queued], waiting: list[Queued], slots: int, pages: int, newcomer_pages: int,
                 throughput: Throughput) -> float:
    """Seconds until a request needing `newcomer_pages` and queued now would start (0 when
    nothing is measured yet): the prefill ahead of it at the measured prefill rate, plus the
    decode steps until its turn (`decode_wait_s`) at the measured step time of their batch."""
    prefill_rate = throughput.prefill_tokens_per_s
    if prefill_rate is None:
        return 0.0
    prefill = sum(r.prefill for r in running) + sum(r.prefill for r in waiting)
    fixed, per_sequence = throughput.decode_line() or (0.0, 0.0)  # fitted once, used at every step below
    decode_s = decode_wait_s(running, waiting, slots, pages, newcomer_pages, lambda b: fixed + per_sequence * b)
    return prefill / prefill_rate + decode_s


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
