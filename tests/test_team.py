"""A CPU worker's team of threads: every core, or one fewer, whichever its steps measure faster."""

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


def test_the_median_pair_decides_over_a_steps_mix_that_differs_between_windows():
    """One trial window in four happens to carry long prompt chunks (cheap per token): one
    pair's ratio says the other team is faster, the median of the trial's four does not."""
    tuner = TeamTuner(2, first_after=1)
    per_token = {1: 1.3e-4, 2: 1e-4}
    for i in range(4 + 4 * 6):  # one window of the current team, then the trial's six
        team, prompt_chunks = tuner.team(), i // 4 == 1  # the trial's first window, on one thread
        tokens = 1024 if prompt_chunks else 128
        tuner.record(tokens, tokens * per_token[team] * (0.5 if prompt_chunks else 1.0))
    assert tuner.trial is None and tuner.current == 2 and tuner.switches == 0
    assert tuner.after == 2  # decided, the same answer: the next trial comes later


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
