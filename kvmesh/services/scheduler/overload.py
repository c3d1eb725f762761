"""Overload refused early: a request that could not start within max_queue_wait_s is refused at
Submit with a retry hint, instead of waiting in the queue and failing late.

A worker's wait for a new request is estimated as the tokens queued ahead of it (prompt still to
compute plus output still to come, of every waiting request) over the tokens per second the
worker has computed in its recent steps, or as the longest a waiting request has waited so far
when that is more (the queue's own sojourn time catches a machine that slowed down after the
estimate). A request is admitted while the estimate is within ADMISSION_HEADROOM of the
queue-wait limit, so that a dip in throughput to a third still lets the admitted requests start
in time; a request that waits past the limit all the same is refused then, never started, with the
same hint (RESOURCE_EXHAUSTED, not an ERROR finish).
"""

from __future__ import annotations

from collections import deque

ADMISSION_HEADROOM = 1 / 3
MIN_RETRY_S = 1.0


class Throughput:
    """Tokens computed per second of step time over a worker's last `window` steps (None before any)."""

    def __init__(self, window: int = 64):
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)

    def record(self, tokens: int, seconds: float) -> None:
        """One step (called on the batching loop: an append, nothing more)."""
        self._steps.append((tokens, seconds))

    @property
    def tokens_per_s(self) -> float | None:
        tokens = sum(t for t, _ in self._steps)
        seconds = sum(s for _, s in self._steps)
        return tokens / seconds if tokens and seconds > 0 else None


def estimated_wait_s(queued_tokens: int, tokens_per_s: float | None) -> float:
    """Seconds until a request queued behind `queued_tokens` starts (0 when nothing is measured yet)."""
    return queued_tokens / tokens_per_s if tokens_per_s else 0.0


def overload_retry_s(wait_s: float, max_queue_wait_s: float) -> float | None:
    """None when a request facing `wait_s` may be queued; else the seconds after which the queue
    should have drained enough to admit it (at least MIN_RETRY_S). A limit of 0 admits everything."""
    allowed = ADMISSION_HEADROOM * max_queue_wait_s
    if not max_queue_wait_s or wait_s <= allowed:
        return None
    return max(MIN_RETRY_S, wait_s - allowed)
