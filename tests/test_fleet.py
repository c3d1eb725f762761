"""The fleet cores (issue 8): autoscaling, the canary split, the rollout controller, health.

Pure logic: every time is an argument, so each case plays out a timeline in a few calls.
"""

import json
import os
import random
import subprocess
import sys
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.fleet.autoscale import AutoscalePolicy, Autoscaler, PoolSignals, warm_pool_size, workers_needed
from kvmesh.fleet.canary import choose_version, split_bucket
from kvmesh.fleet.health import AdmissionRamp, HealthTracker, backoff_delay
from kvmesh.fleet.rollout import (
    RolloutState,
    WindowStats,
    abort,
    canary_percent,
    evaluate,
    serving_stable,
    start_rollout,
)


# --- autoscale -----------------------------------------------------------------------------------

def idle(ready=0) -> PoolSignals:
    return PoolSignals(estimated_token_queue=0, ttft_p95_s=None, ready_workers=ready)


def queued(tokens: int, ready=0) -> PoolSignals:
    return PoolSignals(estimated_token_queue=tokens, ttft_p95_s=None, ready_workers=ready)


@pytest.mark.parametrize(
    "peak, per_worker, warm",
    [
        (100, 10, 12),  # base 10, buffer max(2, 2) = 2
        (200, 10, 24),  # base 20, buffer 4
        (110, 10, 14),  # base 11, buffer ceil(2.2) = 3
        (150, 10, 18),  # base 15, buffer 3 (0.2 * 15 is 3.0000000000000004 in floats)
        (5, 10, 3),  # base 1, buffer 2
        (0, 10, 2),  # no expected traffic: the two-worker buffer alone
        (0.07, 0.01, 9),  # 0.07 / 0.01 is 7.000000000000001: still base 7
    ],
)
def test_warm_pool_is_base_workers_for_peak_plus_twenty_percent_at_least_two(peak, per_worker, warm):
    policy = AutoscalePolicy(rate_per_worker=per_worker, peak_expected_rate=peak, max_workers=100)
    assert warm_pool_size(policy) == warm


@pytest.mark.parametrize(
    "field, value",
    [
        ("tokens_per_worker", 0),
        ("ttft_p95_slo_s", 0.0),
        ("ttft_p95_slo_s", float("nan")),
        ("rate_per_worker", -1.0),
        ("peak_expected_rate", -5.0),
        ("min_workers", -1),
        ("max_workers", 0),
        ("scale_down_delay_s", -1.0),
    ],
)
def test_bad_autoscale_policy_is_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        AutoscalePolicy(**{field: value})


def test_max_workers_below_min_workers_or_the_warm_pool_is_rejected():
    with pytest.raises(ValueError, match="max_workers must be >= 1 and >= min_workers 5, got 4"):
        AutoscalePolicy(min_workers=5, max_workers=4)
    with pytest.raises(ValueError, match="max_workers must be >= the warm pool size 12"):
        AutoscalePolicy(peak_expected_rate=100, rate_per_worker=10, max_workers=11)


def test_queue_of_estimated_tokens_sets_the_worker_count():
    policy = AutoscalePolicy(tokens_per_worker=4000, max_workers=10)
    decision = workers_needed(policy, queued(12000, ready=2), current=2)
    assert decision.workers == 3
    assert decision.reason == "queue 12000 tokens / 4000 per worker"
    assert workers_needed(policy, queued(12001), current=2).workers == 4


def test_ttft_over_the_slo_adds_a_worker_even_with_a_short_queue():
    policy = AutoscalePolicy(ttft_p95_slo_s=1.0, max_workers=10)
    signals = PoolSignals(estimated_token_queue=100, ttft_p95_s=2.1, ready_workers=5)
    decision = workers_needed(policy, signals, current=5)
    assert decision.workers == 6
    assert decision.reason == "ttft p95 2.1s > slo 1.0s"


def test_ttft_at_the_slo_adds_nothing():
    policy = AutoscalePolicy(ttft_p95_slo_s=1.0, max_workers=10)
    signals = PoolSignals(estimated_token_queue=0, ttft_p95_s=1.0, ready_workers=5)
    assert workers_needed(policy, signals, current=5).workers == 2  # the warm pool


def test_ttft_breach_waits_for_starting_workers_instead_of_adding_one_per_evaluation():
    policy = AutoscalePolicy(ttft_p95_slo_s=1.0, max_workers=10)
    signals = PoolSignals(estimated_token_queue=0, ttft_p95_s=3.0, ready_workers=5)
    decision = workers_needed(policy, signals, current=6)
    assert decision.workers == 6
    assert decision.reason == "ttft p95 3.0s > slo 1.0s; waiting for 1 starting workers"


def test_no_ttft_data_leaves_the_pool_to_the_queue_and_floors():
    policy = AutoscalePolicy(max_workers=10)
    assert workers_needed(policy, idle(ready=5), current=5).workers == 2


def test_the_pool_never_goes_below_the_warm_pool_or_min_workers():
    warm = AutoscalePolicy(peak_expected_rate=100, rate_per_worker=10, max_workers=20)
    assert workers_needed(warm, idle(), current=0) == workers_needed(warm, idle(), current=20)
    assert workers_needed(warm, idle(), current=0).workers == 12
    assert workers_needed(warm, idle(), current=0).reason == "warm pool minimum 12"
    floor = AutoscalePolicy(min_workers=4, max_workers=20)
    assert (workers_needed(floor, idle(), 0).workers, workers_needed(floor, idle(), 0).reason) == (4, "min_workers 4")


def test_the_pool_never_goes_above_max_workers():
    policy = AutoscalePolicy(tokens_per_worker=1000, max_workers=8)
    decision = workers_needed(policy, queued(1_000_000), current=3)
    assert decision.workers == 8
    assert decision.reason == "queue 1000000 tokens / 1000 per worker; capped at max_workers 8"


@given(
    queue=st.integers(0, 10**7),
    ttft=st.none() | st.floats(0, 60),
    current=st.integers(0, 50),
    starting=st.integers(0, 5),
)
def test_the_decision_always_lies_between_the_floors_and_max_workers(queue, ttft, current, starting):
    policy = AutoscalePolicy(tokens_per_worker=2000, peak_expected_rate=30, rate_per_worker=10, min_workers=3, max_workers=20)
    signals = PoolSignals(queue, ttft, ready_workers=max(0, current - starting))
    workers = workers_needed(policy, signals, current).workers
    assert max(3, warm_pool_size(policy)) <= workers <= 20
    assert workers >= min(20, -(-queue // 2000))


def test_scale_up_is_immediate():
    scaler = Autoscaler(AutoscalePolicy(tokens_per_worker=1000, max_workers=10, scale_down_delay_s=300))
    assert scaler.desired_workers(queued(2000), current=2, now=0.0).workers == 2
    assert scaler.desired_workers(queued(7000), current=2, now=1.0).workers == 7


def test_scale_down_waits_until_the_lower_count_has_held_for_the_delay():
    scaler = Autoscaler(AutoscalePolicy(tokens_per_worker=1000, max_workers=10, scale_down_delay_s=300))
    scaler.desired_workers(queued(6000), current=6, now=0.0)
    held = scaler.desired_workers(queued(3000), current=6, now=10.0)
    assert held.workers == 6
    assert held.reason.startswith("holding 6: queue 3000 tokens / 1000 per worker")
    assert scaler.desired_workers(queued(3000), current=6, now=309.0).workers == 6
    down = scaler.desired_workers(queued(3000), current=6, now=310.0)
    assert down.workers == 3
    assert down.reason == "queue 3000 tokens / 1000 per worker; lower for 300s"


def test_demand_that_returns_restarts_the_scale_down_delay():
    scaler = Autoscaler(AutoscalePolicy(tokens_per_worker=1000, max_workers=10, scale_down_delay_s=300))
    scaler.desired_workers(queued(3000), current=6, now=0.0)
    scaler.desired_workers(queued(6000), current=6, now=200.0)
    scaler.desired_workers(queued(3000), current=6, now=201.0)
    assert scaler.desired_workers(queued(3000), current=6, now=500.0).workers == 6
    assert scaler.desired_workers(queued(3000), current=6, now=501.0).workers == 3


def test_noisy_demand_scales_down_only_to_the_highest_count_wanted_in_the_window():
    scaler = Autoscaler(AutoscalePolicy(tokens_per_worker=1000, max_workers=10, scale_down_delay_s=60))
    for t in range(0, 200, 10):
        decision = scaler.desired_workers(queued(3000 if t % 20 else 4000), current=8, now=float(t))
    assert decision.workers == 4
    assert decision.reason == "scale down to 4, the most wanted within the last 60s"


def test_a_fresh_autoscaler_watches_a_whole_window_before_scaling_down():
    scaler = Autoscaler(AutoscalePolicy(max_workers=10, scale_down_delay_s=60))
    assert scaler.desired_workers(idle(ready=8), current=8, now=1000.0).workers == 8
    assert scaler.desired_workers(idle(ready=8), current=8, now=1060.0).workers == 2


def test_no_delay_scales_down_at_once():
    scaler = Autoscaler(AutoscalePolicy(max_workers=10, scale_down_delay_s=0))
    assert scaler.desired_workers(idle(ready=8), current=8, now=0.0).workers == 2


def test_time_going_backwards_is_a_value_error():
    scaler = Autoscaler(AutoscalePolicy())
    scaler.desired_workers(idle(), current=2, now=10.0)
    with pytest.raises(ValueError, match="now must not go backwards"):
        scaler.desired_workers(idle(), current=2, now=9.0)


def test_bad_signals_are_value_errors_naming_the_field():
    with pytest.raises(ValueError, match="estimated_token_queue"):
        PoolSignals(-1, None, 0)
    with pytest.raises(ValueError, match="ttft_p95_s"):
        PoolSignals(0, -0.5, 0)
    with pytest.raises(ValueError, match="current"):
        workers_needed(AutoscalePolicy(), idle(), current=-1)


# --- canary split --------------------------------------------------------------------------------

def random_keys(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [str(uuid.UUID(int=rng.getrandbits(128))) for _ in range(n)]


@pytest.mark.parametrize("weight", [1, 5, 25, 50])
def test_canary_share_is_within_three_points_of_its_weight(weight):
    keys = random_keys(2000, seed=weight)
    share = sum(choose_version(k, "v1", "v2", weight) == "v2" for k in keys) / len(keys) * 100
    assert abs(share - weight) <= 3


def test_weight_zero_sends_nothing_to_the_canary_and_hundred_sends_everything():
    keys = random_keys(2000, seed=7)
    assert {choose_version(k, "v1", "v2", 0) for k in keys} == {"v1"}
    assert {choose_version(k, "v1", "v2", 100) for k in keys} == {"v2"}


@given(key=st.text(min_size=1), weight=st.floats(0, 100))
def test_the_same_key_always_gets_the_same_version(key, weight):
    assert choose_version(key, "v1", "v2", weight) == choose_version(key, "v1", "v2", weight)
    assert 0 <= split_bucket(key) < 10_000


@given(key=st.text(min_size=1), low=st.floats(0, 100), high=st.floats(0, 100))
def test_a_key_on_the_canary_stays_there_as_the_weight_grows(key, low, high):
    low, high = sorted((low, high))
    if choose_version(key, "v1", "v2", low) == "v2":
        assert choose_version(key, "v1", "v2", high) == "v2"


def test_the_split_is_identical_in_another_process():
    keys = random_keys(200, seed=3)
    here = [choose_version(k, "v1", "v2", 30) for k in keys]
    code = (
        "import json, sys; from kvmesh.fleet.canary import choose_version; "
        "print(json.dumps([choose_version(k, 'v1', 'v2', 30) for k in json.loads(sys.stdin.read())]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # a different str hash() than this process's
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(keys), capture_output=True, text=True,
                         env=env, check=True)
    assert json.loads(out.stdout) == here


def test_buckets_are_pinned_so_routers_of_different_releases_agree():
    # Changing the hash (or its personalisation) would move users between versions mid-rollout.
    assert [split_bucket(k) for k in ("user-1", "session-42", str(uuid.UUID(int=0)))] == [7227, 6095, 386]


def test_bad_split_input_is_a_value_error():
    with pytest.raises(ValueError, match="canary_percent must be in"):
        choose_version("user-1", "v1", "v2", 101)
    with pytest.raises(ValueError, match="request_key must not be empty"):
        choose_version("", "v1", "v2", 5)


# --- rollout controller --------------------------------------------------------------------------

def stats(requests=1000, errors=0, p99=0.5) -> WindowStats:
    return WindowStats(requests=requests, errors=errors, p99_latency_s=p99)


def rollout(now=0.0, **settings) -> RolloutState:
    return start_rollout("llama", "v1", "v2", now=now, **{"interval_s": 300.0, **settings})


def test_a_rollout_starts_at_the_first_step():
    state = rollout()
    assert (state.status, canary_percent(state)) == ("running", 1.0)
    assert [(d.action, d.reason) for d in state.history] == [("start", "canary v2 at 1%")]


def test_no_advance_before_the_interval_has_elapsed():
    state = rollout()
    assert evaluate(state, stats(), stats(), now=299.0) == state


def test_a_healthy_canary_advances_after_the_interval_with_the_reason():
    state = evaluate(rollout(), stats(), stats(requests=50, p99=0.55), now=300.0)
    assert canary_percent(state) == 5.0
    assert state.step_started_at == 300.0
    last = state.history[-1]
    assert (last.at, last.action, last.percent) == (300.0, "advance", 5.0)
    assert last.reason == "healthy for 300s (50 requests, 0 errors, p99 0.55s vs stable 0.5s); to 5%"


def test_a_healthy_canary_is_promoted_through_every_step():
    state, now, seen = rollout(), 0.0, []
    while state.status == "running":
        seen.append(canary_percent(state))
        now += 300.0
        state = evaluate(state, stats(), stats(), now)
    assert seen == [1.0, 5.0, 25.0, 50.0]
    assert (state.status, canary_percent(state), serving_stable(state)) == ("promoted", 100.0, "v2")
    assert [d.action for d in state.history] == ["start", "advance", "advance", "advance", "promote"]
    assert state.history[-1].reason.endswith("; v2 is stable")
    assert choose_version("any-user", serving_stable(state), state.canary_version, canary_percent(state)) == "v2"


def test_canary_p99_above_one_point_two_times_stable_rolls_back_with_the_reason():
    state = evaluate(rollout(), stats(p99=0.5), stats(requests=100, p99=0.61), now=10.0)
    assert (state.status, canary_percent(state), serving_stable(state)) == ("rolled_back", 0.0, "v1")
    last = state.history[-1]
    assert (last.action, last.reason) == ("rollback", "canary p99 0.61s > 1.2 x stable p99 0.5s")


def test_canary_p99_exactly_one_point_two_times_stable_is_healthy():
    state = evaluate(rollout(), stats(p99=0.5), stats(requests=100, p99=0.6), now=300.0)
    assert canary_percent(state) == 5.0


def test_canary_error_rate_above_a_tenth_of_a_percent_rolls_back_with_the_reason():
    state = evaluate(rollout(), stats(), stats(requests=500, errors=1), now=10.0)
    assert state.status == "rolled_back"
    assert state.history[-1].reason == "canary error rate 0.20% (1/500) > 0.10% (stable 0.00%)"
    at_the_limit = evaluate(rollout(), stats(), stats(requests=1000, errors=1), now=300.0)
    assert at_the_limit.status == "running" and canary_percent(at_the_limit) == 5.0


def test_errors_roll_back_without_waiting_for_min_requests():
    state = evaluate(rollout(min_requests=20), stats(), stats(requests=3, errors=1), now=1.0)
    assert state.status == "rolled_back"


def test_one_slow_request_among_too_few_does_not_roll_back():
    state = evaluate(rollout(min_requests=20), stats(p99=0.5), stats(requests=5, p99=9.0), now=1.0)
    assert state.status == "running"


def test_too_few_canary_requests_wait_at_the_step_with_one_note():
    state = rollout(min_requests=20)
    for now in (300.0, 315.0, 330.0):
        state = evaluate(state, stats(), stats(requests=7), now)
    assert canary_percent(state) == 1.0
    assert [(d.action, d.reason) for d in state.history[1:]] == [("wait", "waiting: 7 canary requests < min_requests 20")]
    state = evaluate(state, stats(), stats(requests=20), now=345.0)
    assert state.history[-1].action == "advance"


def test_a_finished_rollout_does_not_move():
    rolled_back = evaluate(rollout(), stats(), stats(errors=100), now=1.0)
    assert evaluate(rolled_back, stats(), stats(), now=10_000.0) == rolled_back
    assert canary_percent(rolled_back) == 0.0


def test_abort_stops_the_canary_and_records_the_reason():
    state = abort(rollout(), now=42.0, reason="operator: bad outputs reported")
    assert (state.status, canary_percent(state)) == ("aborted", 0.0)
    last = state.history[-1]
    assert (last.at, last.action, last.reason) == (42.0, "abort", "operator: bad outputs reported")
    with pytest.raises(ValueError, match="already aborted"):
        abort(state, now=43.0, reason="again")
    with pytest.raises(ValueError, match="reason"):
        abort(rollout(), now=1.0, reason="")


def test_rollout_state_round_trips_through_json():
    state = evaluate(evaluate(rollout(), stats(), stats(), 300.0), stats(), stats(requests=2), 600.0)
    assert RolloutState.from_json(json.loads(json.dumps(state.to_json()))) == state


def test_unknown_or_missing_rollout_fields_are_rejected():
    data = rollout().to_json()
    with pytest.raises(ValueError, match="unknown rollout field colour"):
        RolloutState.from_json({**data, "colour": "blue"})
    del data["steps"]
    with pytest.raises(ValueError, match="rollout field steps is missing"):
        RolloutState.from_json(data)


@pytest.mark.parametrize("steps", [(), (100,), (5, 1, 100), (1, 5, 50), (0, 50, 100), (1, 150), (1, 1, 100)])
def test_bad_steps_are_rejected(steps):
    with pytest.raises(ValueError, match="steps must rise strictly"):
        rollout(steps=steps)


@pytest.mark.parametrize(
    "field, value",
    [("interval_s", -1.0), ("min_requests", -1), ("max_error_rate", 1.5), ("max_p99_ratio", 0.9), ("status", "paused")],
)
def test_bad_rollout_settings_are_value_errors_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        RolloutState("llama", "v1", "v2", **{field: value})


def test_bad_window_stats_are_rejected():
    with pytest.raises(ValueError, match="errors must be in"):
        WindowStats(requests=5, errors=6, p99_latency_s=0.1)
    with pytest.raises(ValueError, match="p99_latency_s is required"):
        WindowStats(requests=5, errors=0, p99_latency_s=None)


# --- health --------------------------------------------------------------------------------------

def test_three_consecutive_failures_drain_the_worker_once():
    tracker = HealthTracker()
    first = tracker.record("w1", "inference", ok=False, detail="timeout")
    assert (first.old, first.new) == ("healthy", "failing")
    assert tracker.record("w1", "inference", ok=False) is None
    drain = tracker.record("w1", "inference", ok=False, detail="timeout")
    assert (drain.worker_id, drain.old, drain.new) == ("w1", "failing", "drain")
    assert drain.reason == "inference check failed 3 times in a row: timeout"
    assert tracker.record("w1", "inference", ok=False) is None
    assert tracker.record("w1", "inference", ok=True) is None  # drained stays drained
    assert tracker.status("w1") == "drain"


def test_a_device_error_drains_the_worker_at_its_first_report():
    tracker = HealthTracker()
    drain = tracker.record("w1", "device", ok=False, detail="cuda:0 reports 2 uncorrected ECC error(s)")
    assert (drain.old, drain.new) == ("healthy", "drain")
    assert drain.reason == "device check failed 1 times in a row: cuda:0 reports 2 uncorrected ECC error(s)"


def test_a_success_resets_the_failure_count():
    tracker = HealthTracker()
    for ok in (False, False, True, False, False):
        tracker.record("w1", "memory", ok)
    assert tracker.status("w1") == "failing"
    recovered = tracker.record("w1", "memory", ok=True)
    assert (recovered.new, recovered.reason) == ("healthy", "memory check passed")


def test_a_passing_check_does_not_hide_another_failing_every_time():
    tracker = HealthTracker()
    transitions = []
    for _ in range(3):
        transitions.append(tracker.record("w1", "memory", ok=True))
        transitions.append(tracker.record("w1", "inference", ok=False))
    assert transitions[-1].new == "drain"


def test_failures_to_drain_is_configurable_and_workers_are_independent():
    tracker = HealthTracker(failures_to_drain=1)
    assert tracker.record("w1", "inference", ok=False).new == "drain"
    assert tracker.status("w2") == "healthy"
    tracker.forget("w1")
    assert tracker.status("w1") == "healthy"


def test_bad_health_input_is_a_value_error():
    with pytest.raises(ValueError, match="failures_to_drain"):
        HealthTracker(failures_to_drain=0)
    with pytest.raises(ValueError, match="check must be one of inference, memory"):
        HealthTracker().record("w1", "liveliness", ok=False)


@given(attempt=st.integers(0, 10_000), seed=st.integers(0, 2**32))
def test_backoff_is_full_jitter_under_the_capped_exponential(attempt, seed):
    delay = backoff_delay(attempt, base_s=0.1, max_s=30.0, rng=random.Random(seed))
    assert 0.0 <= delay <= min(30.0, 0.1 * 2 ** min(attempt, 64))


def test_backoff_jitter_spreads_over_the_whole_range():
    rng = random.Random(0)
    delays = [backoff_delay(3, base_s=0.5, max_s=30.0, rng=rng) for _ in range(2000)]
    assert min(delays) < 0.2 and max(delays) > 3.8 and max(delays) <= 4.0  # ceiling 0.5 * 2**3


@pytest.mark.parametrize(
    "args, field", [((-1, 0.1, 1.0), "attempt"), ((0, 0.0, 1.0), "base_s"), ((0, 1.0, 0.5), "max_s")]
)
def test_bad_backoff_input_is_a_value_error_naming_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        backoff_delay(*args, rng=random.Random(0))


def test_admission_ramps_linearly_from_start_to_max_over_ramp_s():
    ramp = AdmissionRamp(ready_at=100.0, max_seqs=65, ramp_s=60.0, start_seqs=1)
    assert [ramp.limit(t) for t in (50.0, 100.0, 115.0, 130.0, 160.0, 1e9)] == [1, 1, 17, 33, 65, 65]


def test_no_ramp_admits_the_full_max_at_once():
    assert AdmissionRamp(ready_at=100.0, max_seqs=64, ramp_s=0.0).limit(100.0) == 64


@given(a=st.floats(-100, 200), b=st.floats(-100, 200), max_seqs=st.integers(1, 512), start=st.integers(1, 512))
def test_the_admission_limit_never_falls_and_stays_within_start_and_max(a, b, max_seqs, start):
    ramp = AdmissionRamp(ready_at=0.0, max_seqs=max_seqs, ramp_s=60.0, start_seqs=min(start, max_seqs))
    early, late = sorted((a, b))
    assert ramp.start_seqs <= ramp.limit(early) <= ramp.limit(late) <= max_seqs


@pytest.mark.parametrize(
    "kwargs, field",
    [({"max_seqs": 0}, "max_seqs"), ({"max_seqs": 8, "start_seqs": 9}, "start_seqs"), ({"max_seqs": 8, "ramp_s": -1}, "ramp_s")],
)
def test_bad_admission_ramp_is_a_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        AdmissionRamp(ready_at=0.0, **kwargs)
