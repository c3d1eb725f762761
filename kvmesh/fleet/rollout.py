"""The canary rollout controller: a state machine stepping a new model version up to 100%.

`start_rollout` serves the canary at the first step. Each `evaluate` compares canary and stable
over the same window: it rolls back on a canary error rate above max_error_rate (0.1%) or a
canary p99 above max_p99_ratio (1.2) x the stable p99, and after interval_s at a step with a
healthy canary it advances; passing the step before 100 promotes (the canary gets all traffic
and becomes the stable version). Every decision is kept in `history` with its reason. States are
immutable and round-trip through JSON (`to_json` / `from_json`) so they can live in Redis.

Minimum sample: the canary needs min_requests in the window before a latency verdict or an
advance; with fewer, the rollout waits at its step and notes it once per step, not per call.
Errors need no minimum: at a 0.1% limit one error in fewer than 1000 requests is already over,
so waiting would only serve more failures before the same rollback. Stats should cover the same
window for both versions, and best start no earlier than step_started_at. At low traffic choose a
window that can hold min_requests canary requests, or the rollout waits for ever.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

STATUSES = ("running", "promoted", "rolled_back", "aborted")
DEFAULT_STEPS = (1.0, 5.0, 25.0, 50.0, 100.0)


@dataclass(frozen=True)
class WindowStats:
    """One version's requests, errors and p99 latency (None when it served none) over a window."""

    requests: int
    errors: int
    p99_latency_s: float | None

    def __post_init__(self):
        if self.requests < 0:
            raise ValueError(f"requests must be >= 0, got {self.requests}")
        if not 0 <= self.errors <= self.requests:
            raise ValueError(f"errors must be in [0, requests {self.requests}], got {self.errors}")
        if self.p99_latency_s is None and self.requests:
            raise ValueError(f"p99_latency_s is required when requests > 0, got None for {self.requests} requests")
        if self.p99_latency_s is not None and not self.p99_latency_s >= 0:
            raise ValueError(f"p99_latency_s must be >= 0 or None, got {self.p99_latency_s}")

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


@dataclass(frozen=True)
class RolloutDecision:
    """What the controller did at time `at` (start, wait, advance, promote, rollback, abort) and
    why; `percent` is the canary share after it."""

    at: float
    action: str
    reason: str
    percent: float


@dataclass(frozen=True)
class RolloutState:
    """One model's rollout. steps: canary percents, strictly increasing, in (0, 100], ending at
    100, at least one step before it. step: index into steps. Bad values raise ValueError."""

    model: str
    stable_version: str
    canary_version: str
    steps: tuple[float, ...] = DEFAULT_STEPS
    interval_s: float = 300.0
    min_requests: int = 20
    max_error_rate: float = 0.001
    max_p99_ratio: float = 1.2
    step: int = 0
    status: str = "running"
    step_started_at: float = 0.0
    history: tuple[RolloutDecision, ...] = field(default=())

    def __post_init__(self):
        steps = self.steps
        if len(steps) < 2 or steps[-1] != 100 or steps[0] <= 0 or any(a >= b for a, b in zip(steps, steps[1:])):
            raise ValueError(f"steps must rise strictly from above 0 to a final 100 with a step before it, got {list(steps)}")
        if self.canary_version == self.stable_version:
            raise ValueError(f"canary_version must differ from stable_version, both are {self.stable_version!r}")
        if not self.interval_s >= 0:
            raise ValueError(f"interval_s must be >= 0, got {self.interval_s}")
        if self.min_requests < 0:
            raise ValueError(f"min_requests must be >= 0, got {self.min_requests}")
        if not 0 <= self.max_error_rate < 1:
            raise ValueError(f"max_error_rate must be in [0, 1), got {self.max_error_rate}")
        if not self.max_p99_ratio >= 1:
            raise ValueError(f"max_p99_ratio must be >= 1, got {self.max_p99_ratio}")
        if not 0 <= self.step < len(steps):
            raise ValueError(f"step must be in [0, {len(steps) - 1}], got {self.step}")
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {self.status!r}")

    def to_json(self) -> dict:
        """A dict of JSON types (lists for tuples)."""
        out = dataclasses.asdict(self)
        out["steps"] = list(self.steps)
        out["history"] = [dataclasses.asdict(d) for d in self.history]
        return out

    @classmethod
    def from_json(cls, data: dict) -> RolloutState:
        """Inverse of to_json; an unknown or missing field is a ValueError."""
        names = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(data) - names):
            raise ValueError(f"unknown rollout field {unknown[0]} (known: {', '.join(sorted(names))})")
        if missing := sorted(names - set(data)):
            raise ValueError(f"rollout field {missing[0]} is missing")
        try:
            history = tuple(RolloutDecision(**d) for d in data["history"])
        except TypeError as error:
            raise ValueError(f"bad rollout history entry: {error}") from error
        return cls(**{**data, "steps": tuple(data["steps"]), "history": history})


def start_rollout(model: str, stable_version: str, canary_version: str, now: float, **settings) -> RolloutState:
    """A running rollout at its first step; settings are RolloutState fields (steps, interval_s...)."""
    state = RolloutState(model, stable_version, canary_version, step_started_at=now, **settings)
    return _decide(state, now, "start", f"canary {canary_version} at {state.steps[0]:g}%")


def canary_percent(state: RolloutState) -> float:
    """The canary's share of traffic: the current step while running, 100 once promoted (the
    canary is then the stable version: see `serving_stable`), 0 after a rollback or abort."""
    if state.status == "running":
        return float(state.steps[state.step])
    return 100.0 if state.status == "promoted" else 0.0


def serving_stable(state: RolloutState) -> str:
    """The version that is stable now: the canary once promoted, otherwise the old stable."""
    return state.canary_version if state.status == "promoted" else state.stable_version


def evaluate(state: RolloutState, stable: WindowStats, canary: WindowStats, now: float) -> RolloutState:
    """The state after looking at one window of stats; finished rollouts come back unchanged."""
    if state.status != "running":
        return state
    if canary.error_rate > state.max_error_rate:
        reason = (f"canary error rate {canary.error_rate:.2%} ({canary.errors}/{canary.requests}) "
                  f"> {state.max_error_rate:.2%} (stable {stable.error_rate:.2%})")
        return _decide(state, now, "rollback", reason, status="rolled_back")
    enough = canary.requests >= max(state.min_requests, 1)
    comparable = enough and stable.p99_latency_s is not None
    if comparable and canary.p99_latency_s > state.max_p99_ratio * stable.p99_latency_s:
        reason = f"canary p99 {canary.p99_latency_s:g}s > {state.max_p99_ratio:g} x stable p99 {stable.p99_latency_s:g}s"
        return _decide(state, now, "rollback", reason, status="rolled_back")
    if now - state.step_started_at < state.interval_s:
        return state
    if not comparable:
        if state.history[-1:] and state.history[-1].action == "wait":
            return state  # one note per step is enough
        if enough:
            return _decide(state, now, "wait", "waiting: no stable requests to compare latency with")
        return _decide(state, now, "wait", f"waiting: {canary.requests} canary requests < min_requests {state.min_requests}")
    healthy = (f"healthy for {now - state.step_started_at:g}s ({canary.requests} requests, {canary.errors} errors, "
               f"p99 {canary.p99_latency_s:g}s vs stable {stable.p99_latency_s:g}s)")
    if state.step + 2 == len(state.steps):
        reason = f"{healthy}; {state.canary_version} is stable"
        return _decide(state, now, "promote", reason, status="promoted", step=state.step + 1, step_started_at=now)
    next_step = state.step + 1
    reason = f"{healthy}; to {state.steps[next_step]:g}%"
    return _decide(state, now, "advance", reason, step=next_step, step_started_at=now)


def abort(state: RolloutState, now: float, reason: str) -> RolloutState:
    """Stop a running rollout by hand: canary traffic drops to 0. A finished rollout or an empty
    reason is a ValueError."""
    if state.status != "running":
        raise ValueError(f"rollout of {state.model} is already {state.status}, it cannot be aborted")
    if not reason:
        raise ValueError("reason must not be empty")
    return _decide(state, now, "abort", reason, status="aborted")


def _decide(state: RolloutState, now: float, action: str, reason: str, **changes) -> RolloutState:
    new = dataclasses.replace(state, **changes)
    return dataclasses.replace(new, history=state.history + (RolloutDecision(now, action, reason, canary_percent(new)),))
