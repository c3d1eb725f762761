"""The scheduler's fleet bookkeeping on its own: rollout windows from finished requests."""

import time

from kvmesh.fleet.rollout import evaluate, start_rollout
from kvmesh.params import SamplingParams, StoppingParams
from kvmesh.services.scheduler.fleet import Outcomes
from kvmesh.services.scheduler.request import FinishReason, Request


def finished(version_outcomes: Outcomes, version: str, reason: FinishReason, latency_s: float) -> None:
    req = Request("r", [1, 2, 3], SamplingParams(), StoppingParams(max_new_tokens=4))
    req.arrival_time = time.monotonic() - latency_s
    req.finish_time, req.finish_reason = time.monotonic(), reason
    version_outcomes.record(version, req)


def test_a_canary_whose_every_request_fails_is_rolled_back():
    outcomes = Outcomes()
    for _ in range(5):
        finished(outcomes, "v1", FinishReason.LENGTH, 0.2)
        finished(outcomes, "v2", FinishReason.ERROR, 0.01)
    now = time.time()
    window = {v: outcomes.window(v, now - 60) for v in ("v1", "v2")}
    assert window["v2"].requests == window["v2"].errors == 5 and window["v2"].p99_latency_s is not None
    state = evaluate(start_rollout("default", "v1", "v2", now - 1), window["v1"], window["v2"], now)
    assert state.status == "rolled_back" and "error rate" in state.history[-1].reason


def test_cancelled_requests_say_nothing_about_a_version():
    outcomes = Outcomes()
    finished(outcomes, "v2", FinishReason.CANCELLED, 0.5)
    finished(outcomes, "v2", FinishReason.LENGTH, 0.3)
    window = outcomes.window("v2", time.time() - 60)
    assert window.requests == 1 and window.errors == 0 and abs(window.p99_latency_s - 0.3) < 0.05
