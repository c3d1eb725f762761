"""Worker health bookkeeping: when to drain a worker, how long to wait between retries, and how
fast a newly ready worker takes load. No I/O and no clock: the caller passes results and times."""

from __future__ import annotations

import random
from dataclasses import dataclass

CHECKS = ("inference", "memory", "device")
# A device's own error report (uncorrected ECC, a critical XID) is no flake to wait out: the first
# one drains the worker, before more answers come from memory that cannot be trusted.
DRAIN_AT_ONCE = frozenset({"device"})
HEALTHY, FAILING, DRAIN = "healthy", "failing", "drain"


@dataclass(frozen=True)
class HealthTransition:
    """A worker's status changed (healthy -> failing -> drain, or failing -> healthy); act on it once."""

    worker_id: str
    old: str
    new: str
    reason: str


class HealthTracker:
    """Consecutive failures per worker and per check. A check failing failures_to_drain times in a
    row (default 3) puts the worker in `drain`: it needs draining and replacing, and stays there
    (later results are ignored) until `forget`. A success resets that check's count. Checks count
    separately, so a passing memory check does not hide an inference check failing every time.
    A check in DRAIN_AT_ONCE drains at its first failure.
    An unknown check name or failures_to_drain < 1 is a ValueError."""

    def __init__(self, failures_to_drain: int = 3):
        if failures_to_drain < 1:
            raise ValueError(f"failures_to_drain must be >= 1, got {failures_to_drain}")
        self.failures_to_drain = failures_to_drain
        self._failures: dict[str, dict[str, int]] = {}
        self._drained: set[str] = set()

    def status(self, worker_id: str) -> str:
        if worker_id in self._drained:
            return DRAIN
        return FAILING if any(self._failures.get(worker_id, {}).values()) else HEALTHY

    def record(self, worker_id: str, check: str, ok: bool, detail: str = "") -> HealthTransition | None:
        """Count one check result; the transition it caused, or None."""
        if check not in CHECKS:
            raise ValueError(f"check must be one of {', '.join(CHECKS)}, got {check!r}")
        old = self.status(worker_id)
        if old == DRAIN:
            return None
        counts = self._failures.setdefault(worker_id, {})
        counts[check] = 0 if ok else counts.get(check, 0) + 1
        if counts[check] >= (1 if check in DRAIN_AT_ONCE else self.failures_to_drain):
            self._drained.add(worker_id)
        new = self.status(worker_id)
        if new == old:
            return None
        if ok:
            return HealthTransition(worker_id, old, new, f"{check} check passed")
        reason = f"{check} check failed {counts[check]} times in a row"
        return HealthTransition(worker_id, old, new, f"{reason}: {detail}" if detail else reason)

    def forget(self, worker_id: str) -> None:
        """Drop a worker that has left (drained and replaced, or gone)."""
        self._failures.pop(worker_id, None)
        self._drained.discard(worker_id)


def backoff_delay(attempt: int, base_s: float, max_s: float, rng: random.Random) -> float:
    """Seconds to wait before retry `attempt` (0 for the first): full jitter, uniform in
    [0, min(max_s, base_s * 2**attempt)]. Full jitter (not equal or decorrelated) spreads the
    retries of many clients that failed together, say on a Redis restart, over the whole range,
    which keeps the peak load on the recovering service lowest; a single retry may come early.
    attempt < 0, base_s <= 0 or max_s < base_s is a ValueError."""
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt}")
    if not base_s > 0:
        raise ValueError(f"base_s must be > 0, got {base_s}")
    if not max_s >= base_s:
        raise ValueError(f"max_s must be >= base_s {base_s}, got {max_s}")
    ceiling = min(max_s, base_s * 2 ** min(attempt, 64))  # 2**64 outgrows any max_s; avoids float overflow
    return rng.uniform(0.0, ceiling)


@dataclass(frozen=True)
class AdmissionRamp:
    """A newly ready worker's cap on running sequences: start_seqs at ready_at, rising linearly to
    max_seqs at ready_at + ramp_s. Linear rather than doubling: the worker's capacity is known
    (max_seqs), so there is nothing to probe as TCP slow start does; what is unknown is how long
    its caches and compiled kernels take to warm, and a straight line gives it load at an even
    pace over that time instead of the last half arriving in the final doubling.
    Bad values raise ValueError naming the field."""

    ready_at: float
    max_seqs: int
    ramp_s: float = 30.0
    start_seqs: int = 1

    def __post_init__(self):
        if self.max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1, got {self.max_seqs}")
        if not 1 <= self.start_seqs <= self.max_seqs:
            raise ValueError(f"start_seqs must be in [1, max_seqs {self.max_seqs}], got {self.start_seqs}")
        if not self.ramp_s >= 0:
            raise ValueError(f"ramp_s must be >= 0, got {self.ramp_s}")

    def limit(self, now: float) -> int:
        """Running sequences the worker may hold at `now`; start_seqs before ready_at."""
        elapsed = now - self.ready_at
        if elapsed >= self.ramp_s:
            return self.max_seqs
        if elapsed <= 0:
            return self.start_seqs
        return self.start_seqs + int(elapsed / self.ramp_s * (self.max_seqs - self.start_seqs))
