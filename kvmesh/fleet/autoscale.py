"""How many workers a model pool should run: from the token queue, the TTFT SLO and a warm pool.

`workers_needed` is the stateless rule; `Autoscaler` adds scale-down hysteresis. No I/O, no clock
reads: the caller passes the signals and the time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class AutoscalePolicy:
    """One model pool's scaling policy.

    tokens_per_worker: estimated queued tokens one worker absorbs. ttft_p95_slo_s: the TTFT p95 the
    pool must meet. rate_per_worker: requests/s one worker sustains. peak_expected_rate: the peak
    requests/s the warm pool is sized for. min_workers, max_workers: hard bounds.
    scale_down_delay_s: a lower count must have been wanted this long before the pool shrinks.
    Bad values raise ValueError naming the field and the limit; so does a max_workers below the
    warm pool, since both bounds could not hold.
    """

    tokens_per_worker: int = 4000
    ttft_p95_slo_s: float = 1.0
    rate_per_worker: float = 10.0
    peak_expected_rate: float = 0.0
    min_workers: int = 1
    max_workers: int = 8
    scale_down_delay_s: float = 300.0

    def __post_init__(self):
        # `not x > 0` also rejects NaN.
        if not self.tokens_per_worker >= 1:
            raise ValueError(f"tokens_per_worker must be >= 1, got {self.tokens_per_worker}")
        if not self.ttft_p95_slo_s > 0:
            raise ValueError(f"ttft_p95_slo_s must be > 0, got {self.ttft_p95_slo_s}")
        if not self.rate_per_worker > 0:
            raise ValueError(f"rate_per_worker must be > 0, got {self.rate_per_worker}")
        if not 0 <= self.peak_expected_rate < math.inf:
            raise ValueError(f"peak_expected_rate must be >= 0 and finite, got {self.peak_expected_rate}")
        if not self.min_workers >= 0:
            raise ValueError(f"min_workers must be >= 0, got {self.min_workers}")
        if not self.max_workers >= max(1, self.min_workers):
            raise ValueError(f"max_workers must be >= 1 and >= min_workers {self.min_workers}, got {self.max_workers}")
        if not self.scale_down_delay_s >= 0:
            raise ValueError(f"scale_down_delay_s must be >= 0, got {self.scale_down_delay_s}")
        warm = warm_pool_size(self)
        if self.max_workers < warm:
            raise ValueError(
                f"max_workers must be >= the warm pool size {warm} (peak_expected_rate "
                f"{self.peak_expected_rate} / rate_per_worker {self.rate_per_worker} plus buffer), got {self.max_workers}"
            )


@dataclass(frozen=True)
class PoolSignals:
    """What the pool looks like now. ttft_p95_s is None when there is no data (no recent requests).
    ready_workers: workers serving now; the rest of `current` are still starting."""

    estimated_token_queue: int
    ttft_p95_s: float | None
    ready_workers: int

    def __post_init__(self):
        if self.estimated_token_queue < 0:
            raise ValueError(f"estimated_token_queue must be >= 0, got {self.estimated_token_queue}")
        if self.ttft_p95_s is not None and not self.ttft_p95_s >= 0:
            raise ValueError(f"ttft_p95_s must be >= 0 or None, got {self.ttft_p95_s}")
        if self.ready_workers < 0:
            raise ValueError(f"ready_workers must be >= 0, got {self.ready_workers}")


@dataclass(frozen=True)
class Decision:
    """The worker count to run and why, in words an operator reads in a log."""

    workers: int
    reason: str


def warm_pool_size(policy: AutoscalePolicy) -> int:
    """warm = base + buffer, base = ceil(peak_expected_rate / rate_per_worker),
    buffer = max(2, ceil(0.2 * base)).

    The seed rule reads `buffer = max(2, 0.2 * warm)`, which defines warm in terms of itself; the
    20% is taken of the base count instead. Peak 100 req/s at 10 per worker: 10 + 2 = 12;
    peak 200: 20 + 4 = 24.
    """
    # round() first: float noise such as 0.07 / 0.01 = 7.000000000000001 must not add a worker.
    base = math.ceil(round(policy.peak_expected_rate / policy.rate_per_worker, 9))
    return base + max(2, -(-base // 5))  # integer ceil(base / 5): 0.2 * 15 is 3.0000000000000004


def _secs(value: float) -> str:
    return f"{round(value, 3)}s"


def workers_needed(policy: AutoscalePolicy, signals: PoolSignals, current: int) -> Decision:
    """The count the pool needs now, without hysteresis: the largest of the queue demand
    (ceil(queue / tokens_per_worker)), current + 1 while TTFT p95 exceeds the SLO, the warm pool
    and min_workers; then capped at max_workers. A TTFT breach adds one worker only once every
    current worker is ready: until then the last one added has not had a chance to help, and
    adding one per evaluation would run the pool up to max_workers."""
    if current < 0:
        raise ValueError(f"current must be >= 0, got {current}")
    queue = signals.estimated_token_queue
    by_queue = math.ceil(queue / policy.tokens_per_worker)
    candidates = [Decision(by_queue, f"queue {queue} tokens / {policy.tokens_per_worker} per worker")]
    ttft = signals.ttft_p95_s
    if ttft is not None and ttft > policy.ttft_p95_slo_s:
        breach = f"ttft p95 {_secs(ttft)} > slo {_secs(policy.ttft_p95_slo_s)}"
        starting = current - signals.ready_workers
        if starting > 0:
            candidates.insert(0, Decision(current, f"{breach}; waiting for {starting} starting workers"))
        else:
            candidates.insert(0, Decision(current + 1, breach))
    warm = warm_pool_size(policy)
    candidates.append(Decision(warm, f"warm pool minimum {warm}"))
    candidates.append(Decision(policy.min_workers, f"min_workers {policy.min_workers}"))
    best = max(candidates, key=lambda d: d.workers)  # the first of equals: demand before floors
    if best.workers > policy.max_workers:
        return Decision(policy.max_workers, f"{best.reason}; capped at max_workers {policy.max_workers}")
    return best


class Autoscaler:
    """`workers_needed` plus scale-down hysteresis for one pool.

    Scaling up is immediate. The pool shrinks to N only once every count wanted during the last
    scale_down_delay_s was <= N (the highest recent count wins, as in the Kubernetes HPA
    stabilization window), so demand that dips and returns does not churn workers. A fresh
    Autoscaler (say, after a restart) must observe a whole window before it scales down.
    `now` is any monotonic clock in seconds and must not go backwards (ValueError).
    """

    def __init__(self, policy: AutoscalePolicy):
        self.policy = policy
        self._wanted: deque[tuple[float, int]] = deque()  # (since when, count wanted)

    def desired_workers(self, signals: PoolSignals, current: int, now: float) -> Decision:
        """The count to run now, given `current` workers (ready or starting), and why."""
        if self._wanted and now < self._wanted[-1][0]:
            raise ValueError(f"now must not go backwards: {now} < {self._wanted[-1][0]}")
        need = workers_needed(self.policy, signals, current)
        self._wanted.append((now, need.workers))
        cutoff = now - self.policy.scale_down_delay_s
        # Each count holds until the next one, so keep the one in force at the window's start.
        while len(self._wanted) >= 2 and self._wanted[1][0] <= cutoff:
            self._wanted.popleft()
        if need.workers >= current:
            return need
        hold, window = min(current, self.policy.max_workers), _secs(self.policy.scale_down_delay_s)
        if self._wanted[0][0] > cutoff:
            return Decision(hold, f"holding {hold}: {need.reason}; scale down waits {_secs(self._wanted[0][0] - cutoff)} more")
        floor = max(count for _, count in self._wanted)
        if floor >= hold:
            return Decision(hold, f"holding {hold}: {floor} wanted within the last {window}")
        if floor == need.workers:
            return Decision(floor, f"{need.reason}; lower for {window}")
        return Decision(floor, f"scale down to {floor}, the most wanted within the last {window}")
