"""KV-aware worker choice: prefix overlap against load, the balance guard, and ties."""

from kvmesh.services.scheduler.placement import PlacementConfig, WorkerView, choose_worker

CFG = PlacementConfig()


def test_the_worker_holding_the_prefix_wins_at_similar_load():
    views = [WorkerView("a", 0, 10, 0), WorkerView("b", 18, 14, 40)]
    assert choose_worker(19, views, CFG).worker_id == "b"


def test_a_worker_too_far_above_the_least_loaded_is_not_a_candidate():
    # b holds the prefix but carries 40 pages more work than a: past the 32-page slack.
    views = [WorkerView("a", 0, 0, 0), WorkerView("b", 18, 40, 40)]
    assert choose_worker(19, views, CFG).worker_id == "a"
    assert choose_worker(19, views, PlacementConfig(balance_slack_pages=64)).worker_id == "b"


def test_the_guard_grows_with_load():
    # Lowest load 100: b may be up to 50 pages (balance_ratio 0.5) above it.
    views = [WorkerView("a", 0, 100, 0), WorkerView("b", 18, 145, 40)]
    assert choose_worker(19, views, CFG).worker_id == "b"


def test_ties_go_to_the_worker_holding_fewer_pages_then_by_id():
    assert choose_worker(4, [WorkerView("a", 0, 0, 30), WorkerView("b", 0, 0, 0)], CFG).worker_id == "b"
    assert choose_worker(4, [WorkerView("b", 0, 0, 0), WorkerView("a", 0, 0, 0)], CFG).worker_id == "a"


def test_unknown_policy_is_an_error_naming_the_setting():
    try:
        PlacementConfig(policy="random")
    except ValueError as e:
        assert "worker_choice" in str(e)
    else:
        raise AssertionError("accepted an unknown policy")
