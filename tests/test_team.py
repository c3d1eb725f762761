"""A CPU worker's team of threads: the one its steps measure fastest, walked down from every core."""

import random

import pytest
import torch

from kvmesh.services.worker.team import TeamTuner


def run(tuner: TeamTuner, per_token_s: dict[int, float], steps: int, tokens=lambda i: 128) -> list[int]:
    """Steps whose forward pass costs `per_token_s[team]` a token; the team of each step."""
    teams = []
    for i in range(steps):
        team = tuner.team()
        teams.append(team)
        tuner.record(tokens(i), tokens(i) * per_token_s[team])
    return teams


def test_a_host_where_one_thread_fewer_is_faster_moves_to_it_and_stays():
    """Two cores; steps run 25% faster on one thread (a small model beside the rest of the mesh):
    after the first trial (2 windows of 4 steps, then 3 pairs of windows) every step but the
    later trials' runs on one thread, and the trials of two threads end at their first pair."""
    tuner = TeamTuner(2)
    teams = run(tuner, {1: 0.75e-4, 2: 1e-4}, 4000)
    assert tuner.current == 1 and tuner.switches == 1
    assert teams[:8] == [2] * 8 and teams[8:12] == [1] * 4  # the trial's first window: the other team
    decided = 8 + 2 * 3 * 4
    assert teams[decided:decided + 8] == [1] * 8
    assert teams[decided:].count(2) <= 4 * 10  # one window of two threads per trial, trials ever rarer
    assert tuner.after > tuner.first_after


def test_a_model_that_needs_every_core_keeps_them_and_pays_one_window_per_trial():
    tuner = TeamTuner(2)
    teams = run(tuner, {1: 1.8e-4, 2: 1e-4}, 20000)
    assert tuner.current == 2 and tuner.switches == 0
    # Trials after 8, 16, 32, ... steps of the current team (2048 at most), one window (4 steps) each.
    trials = 0
    run_steps, after = 0, tuner.first_after
    while run_steps + after * 4 + 8 <= 20000:
        run_steps += after * 4 + 8
        trials += 1
        after = min(tuner.max_after, 2 * after)
    assert trials - 1 <= teams.count(1) // 4 <= trials + 1
    assert teams.count(1) / len(teams) < 0.005
    assert tuner.after == tuner.max_after


def test_a_difference_within_the_margin_changes_nothing():
    tuner = TeamTuner(4)
    run(tuner, {3: 0.93e-4, 4: 1e-4}, 5000)
    assert tuner.current == 4 and tuner.switches == 0


def test_a_pair_of_windows_whose_steps_mix_differs_is_left_out_of_the_trial():
    """The trial's first window happens to carry long prompt chunks (cheap per token): its pair
    would say the other team is faster. Its windows computed 8x the tokens a step of each other,
    so that pair is not counted: the trial takes one pair more, and its three counted pairs keep
    the current team."""
    tuner = TeamTuner(2, first_after=1)
    per_token = {1: 1.2e-4, 2: 1e-4}  # slower, not clearly (25%): the trial runs its three counted pairs
    for i in range(4 + 4 * 8):  # one window of the current team, then the trial's eight
        if i == 4 + 4 * 6:
            assert tuner.trial is not None and len(tuner.trial) == 7  # three pairs, two counted
        team, prompt_chunks = tuner.team(), i // 4 == 1  # the trial's first window, on one thread
        tokens = 1024 if prompt_chunks else 128
        tuner.record(tokens, tokens * per_token[team] * (0.5 if prompt_chunks else 1.0))
    assert tuner.trial is None and tuner.current == 2 and tuner.switches == 0
    assert tuner.after == 2  # decided, the same answer: the next trial comes later


def test_a_light_model_whose_first_steps_favour_every_core_still_moves_when_its_mix_settles():
    """The cheap model through the mesh: its first steps are whole prompt chunks, faster on both
    threads (the first trial ends at its first pair), then its steps settle into decode rows,
    faster on one. Its trials take hundredths of a second, within the first second's grace, so
    the next ones come by step count and find the faster team."""
    tuner = TeamTuner(2)
    prompts = {1: 2e-6, 2: 1e-6}  # per token, 1024-token steps
    decodes = {1: 0.75e-5, 2: 1e-5}  # per token, 128-row steps
    teams = run(tuner, prompts, 24, tokens=lambda i: 1024)
    assert tuner.current == 2 and teams.count(1) == 4  # one window: clearly slower
    teams = run(tuner, decodes, 400)
    assert tuner.current == 1 and teams.index(1) < 40


def test_a_trial_none_of_whose_pairs_compare_decides_nothing_and_the_next_comes_as_soon():
    """Every window of the other team happens to carry prompt chunks, every one of the current
    team decode rows: after six pairs the trial ends with no answer, the team stays, and the next
    trial comes as soon as this one did (an answer, not a guess, makes trials rarer), while such
    trials' windows stay within the first second's grace."""
    tuner = TeamTuner(2)
    for _ in range(8 + 4 * 12):
        team = tuner.team()
        tokens = 1024 if team == 1 else 128
        tuner.record(tokens, tokens * 1e-5 * (0.5 if team == 1 else 1.0))
    assert tuner.trial is None and tuner.current == 2 and tuner.switches == 0
    assert tuner.after == tuner.first_after and 0 < tuner.tried < tuner.grace_s
    for _ in range(tuner.first_after * tuner.window):
        assert tuner.team() == 2
        tuner.record(128, 0.00128)
    assert tuner.trial is not None and tuner.team() == 1  # the next trial, after 8 steps as the first


def test_trials_that_decide_nothing_are_held_back_once_they_cost_more_than_the_grace():
    """The same mixes for a heavy model: six windows of prompt steps on one thread take 12 s, so
    the next trial waits until that is under a second plus 1% of the forward time."""
    tuner = TeamTuner(2)
    for _ in range(8 + 4 * 12):
        team = tuner.team()
        tokens = 1024 if team == 1 else 128
        tuner.record(tokens, tokens * 1e-3 * (0.5 if team == 1 else 1.0))
    assert tuner.trial is None and tuner.switches == 0 and tuner.tried > tuner.grace_s
    for _ in range(200):  # 200 decode steps of 0.128 s: 25.6 s, where 1,100 s would be needed
        assert tuner.team() == 2
        tuner.record(128, 0.128)
    assert tuner.trial is None


def test_trials_that_change_nothing_take_at_most_a_hundredth_of_the_forward_time():
    """A heavy model under load: its steps are long prompt chunks, a window of them on one thread
    fewer costs seconds, and trials by step count alone (after 8, 16, 32, ... steps) spent 1.9%
    of these 3,000 steps' time on the slower team. Trials now wait while the other team's windows
    have taken over a second plus 1% of all forward time."""
    per_token = {1: 1.8e-3, 2: 1e-3}
    tuner = TeamTuner(2)
    teams = run(tuner, per_token, 3000, tokens=lambda i: 1024)
    assert tuner.current == 2 and tuner.switches == 0
    seconds = {k: teams.count(k) * 1024 * per_token[k] for k in per_token}
    window = 4 * 1024 * per_token[1]
    assert seconds[1] <= tuner.grace_s + 0.01 * (seconds[1] + seconds[2]) + window  # at most the window that crossed it
    assert teams[:12].count(1) == 4  # the first trial (after 8 steps) is not held back
    assert tuner.tried == pytest.approx(seconds[1])


def busy_host(cores: int, best: int) -> dict[int, float]:
    """Time per token on each team of a host where the rest of the mesh keeps cores - best cores
    busy: every thread past `best` waits at each parallel region's end (15% a thread), fewer
    threads than `best` compute slower (15% a thread)."""
    return {k: 1e-4 * (1 + 0.15 * abs(k - best)) for k in range(1, cores + 1)}


def test_a_many_core_host_busy_beside_the_worker_is_walked_down_to_its_best_team_and_stays():
    """16 cores, three of them kept busy by the rest of the mesh: each trial that moves down is
    followed by one a thread lower, until a thread fewer no longer pays; then the trials alternate
    a thread fewer and every core, both slower, and come ever rarer."""
    tuner = TeamTuner(16)
    teams = run(tuner, busy_host(16, 13), 20000)
    assert tuner.current == 13 and tuner.switches == 3
    settled = len(teams) - teams[::-1].index(14)  # past the trial that moved from 14 to 13
    assert settled < 200  # three trials of 8 steps before and 24 in each
    assert set(teams[settled:]) == {12, 13, 16}  # the trials' windows: a thread fewer, every core
    assert teams[settled:].count(13) / len(teams[settled:]) > 0.99


def test_a_team_walked_down_goes_back_to_every_core_when_the_host_frees_them():
    """The walk down ended at 13 threads; the rest of the mesh then goes idle, and every core takes
    19% less time a token than 13 (one thread more would take 7% less, inside the margin): the
    next trial that tries every core moves there."""
    tuner = TeamTuner(16)
    run(tuner, busy_host(16, 13), 2000)
    assert tuner.current == 13
    free = {k: 1e-4 * 16 / k for k in range(1, 17)}  # a worker alone: every thread computes
    teams = run(tuner, free, 6000)
    assert tuner.current == 16 and teams[-1] == 16
    assert teams.index(16) < 2 * 4 * tuner.max_after  # within the longest wait between two trials


def test_steps_computing_nothing_are_not_counted_and_one_core_has_nothing_to_tune():
    tuner = TeamTuner(2)
    for _ in range(1000):
        tuner.record(0, 0.01)
    assert tuner.trial is None and tuner.ran.steps == 0
    with pytest.raises(ValueError, match="2 or more cores"):
        TeamTuner(1)


def test_a_team_changed_between_steps_leaves_every_token_and_logprob_as_it_was(hf_checkpoint):
    """What the worker does when its team changes: the step thread's torch threads are set
    between two steps. A batch of six (prompts over several pages, prefilled in chunks beside
    decodes) run with the team changed at every step gives bit-identical greedy tokens and
    logprobs to the same batch on a fixed team of two, and matches transformers."""
    from kvmesh.engine import EngineConfig, LLMEngine
    from kvmesh.params import SamplingParams, StoppingParams
    from kvmesh.services.scheduler.core import SchedulerConfig
    from reference import assert_matches_reference, hf_greedy

    model_dir = hf_checkpoint("llama")
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(20, 70))] for _ in range(6)]
    stopping = StoppingParams(max_new_tokens=12, ignore_eos=True)
    kept = torch.get_num_threads()

    def run(teams):
        engine = LLMEngine(EngineConfig(model=model_dir, num_pages=128, scheduler=SchedulerConfig(max_batched_tokens=48)))
        reqs = [engine.add_request(p, SamplingParams(temperature=0.0), stopping) for p in prompts]
        steps = 0
        while engine.has_unfinished():
            torch.set_num_threads(teams[steps % len(teams)])
            engine.step()
            steps += 1
        return [(list(r.output_token_ids), list(r.output_logprobs)) for r in reqs], steps

    try:
        fixed, _ = run([2])
        changing, steps = run([1, 2])
    finally:
        torch.set_num_threads(kept)
    assert steps > 12 and changing == fixed
    for prompt, (tokens, logprobs) in zip(prompts, changing):
        assert assert_matches_reference(tokens, logprobs, hf_greedy(model_dir, prompt, 12)) > 0


def test_a_worker_reports_the_cores_its_tuned_team_leaves_and_none_for_a_set_team(hf_checkpoint):
    """What a scheduler with overlap_steps auto follows: a CPU worker's step results carry the cores
    its thread tuner's current team leaves free (not a trial's team: overlap would flip with every
    window), and none where --threads set the team (other workers may run on the host's other
    cores)."""
    from kvmesh.params import SamplingParams
    from kvmesh.services.worker.model import CausalLM
    from kvmesh.services.worker.runner import ModelRunner
    from kvmesh.services.worker.server import WorkerService
    from kvmesh.services.worker.team import _Window
    from kvmesh.step import NewSequence, ScheduledChunk, StepPlan

    service = WorkerService()
    service.runner = ModelRunner(CausalLM.load(hf_checkpoint("llama")), num_pages=8)
    ids = [5, 9, 31, 7, 77, 12]
    kept = torch.get_num_threads()
    reports, tokens = [], []
    try:
        plan = StepPlan(new=[NewSequence("a", ids, len(ids), SamplingParams(temperature=0.0), [0, 1])],
                        scheduled=[ScheduledChunk("a", len(ids))])
        for tuner in (None, TeamTuner(2), TeamTuner(2), TeamTuner(2)):
            service.team = tuner
            if tuner is not None and len(reports) >= 2:
                tuner.current, tuner.other = 1, 2  # the tuner moved to one thread
            if tuner is not None and len(reports) == 3:
                tuner.trial = [_Window()]  # a trial's first window: its steps run on the other team, two threads
                assert tuner.team() == 2
            result, _, _ = service._step(plan)
            reports.append(result.spare_cores)
            tokens.append([t.token_id for t in result.tokens])
            plan = StepPlan(scheduled=[ScheduledChunk("a", 1)])
    finally:
        torch.set_num_threads(kept)
    assert reports == [0, 0, 1, 1]
    assert all(len(t) == 1 for t in tokens)
