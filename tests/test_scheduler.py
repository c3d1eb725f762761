"""The scheduler's core, driven step by step with a real PagePool and no model.

`LevelWorker` does with each plan what the worker does (kvmesh/services/worker/runner.py),
minus the forward pass: it applies the deltas (dropped, new, appended pages), checks they
rebuild the scheduler's own view of every sequence, and samples each sequence the step brings
level with its known tokens. The token it samples depends only on the position, so a request's
expected output is known in advance, preempted or not.
"""

import random
from collections import deque
from dataclasses import dataclass

import pytest

from kvmesh.params import SamplingParams, StoppingParams
from kvmesh.services.kvcache.pages import PagePool
from kvmesh.services.scheduler.core import Scheduler, SchedulerConfig
from kvmesh.services.scheduler.request import FinishReason, Request, Status
from kvmesh.step import SampledToken, StepPlan, StepResult


def sampled_token(position: int) -> int:
    return 1000 + position


def expected_output(request: Request) -> list[int]:
    n = len(request.prompt_token_ids)
    return [sampled_token(n + i) for i in range(request.stopping.max_new_tokens)]


def make_request(request_id, prompt, max_new=4, priority=0, arrival=0.0) -> Request:
    return Request(
        request_id,
        list(prompt),
        SamplingParams(temperature=0.0),
        StoppingParams(max_new_tokens=max_new),
        priority=priority,
        arrival_time=arrival,
    )


@dataclass
class WorkerSequence:
    token_ids: list[int]
    page_ids: list[int]
    num_computed: int


class LevelWorker:
    """The worker's side of the step contract, without a model (see the module docstring)."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.seqs: dict[str, WorkerSequence] = {}

    def step(self, plan: StepPlan) -> StepResult:
        pool, requests = self.scheduler.pool, self.scheduler.requests
        for seq_id in plan.dropped:
            self.seqs.pop(seq_id, None)
        for new in plan.new:
            assert new.seq_id not in self.seqs
            self.seqs[new.seq_id] = WorkerSequence(list(new.token_ids), list(new.page_ids), new.num_computed_tokens)
        tokens = []
        for chunk in plan.scheduled:
            seq = self.seqs[chunk.seq_id]
            seq.page_ids.extend(chunk.new_page_ids)
            # The deltas rebuild exactly what the scheduler holds for this sequence.
            assert seq.page_ids == pool.page_table(chunk.seq_id)
            if chunk.seq_id in self.scheduler.padding:  # a finished row of a padded static batch
                assert seq.num_computed == self.scheduler.padding[chunk.seq_id] and chunk.num_tokens == 1
            else:
                # The scheduler counts this chunk, and the one of a plan still out (overlapped
                # steps), as in flight: the worker has computed that one, and sampled its token.
                req = requests[chunk.seq_id]
                assert seq.num_computed == req.num_computed_tokens + req.num_inflight_tokens - chunk.num_tokens
                out_before = req.num_inflight_tokens - chunk.num_tokens  # the plan out's tokens
                sampled_out = out_before and req.num_computed_tokens + out_before == req.num_tokens
                assert seq.token_ids == req.token_ids + seq.token_ids[req.num_tokens:][:1 if sampled_out else 0]
            assert chunk.num_tokens >= 1
            seq.num_computed += chunk.num_tokens
            assert seq.num_computed <= min(len(seq.token_ids), len(seq.page_ids) * pool.page_size)
            if seq.num_computed == len(seq.token_ids):  # level: sample
                token = sampled_token(len(seq.token_ids))
                seq.token_ids.append(token)
                tokens.append(SampledToken(chunk.seq_id, token, -1.0))
        return StepResult(tokens)


class Run:
    """A scheduler, its pool and a LevelWorker, stepped together; keeps every event it sees."""

    def __init__(self, num_pages=64, page_size=2, **config):
        self.pool = PagePool(num_pages, page_size)
        self.scheduler = Scheduler(self.pool, SchedulerConfig(**config))
        self.worker = LevelWorker(self.scheduler)
        self.requests: dict[str, Request] = {}
        self.streams: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, list[FinishReason]] = {}

    def add(self, *requests: Request) -> None:
        for r in requests:
            self.requests[r.request_id] = r
            self.streams[r.request_id] = []
            self.finish_reasons[r.request_id] = []
            self.scheduler.add(r)

    def schedule(self) -> StepPlan:
        plan = self.scheduler.schedule()
        assert plan.num_tokens <= self.scheduler.config.max_batched_tokens
        self.pool.check()
        return plan

    def finish_step(self, plan: StepPlan, result: StepResult):
        events = self.scheduler.update(plan, result)
        for e in events:
            if e.token_id is not None:
                self.streams[e.request.request_id].append(e.token_id)
            if e.finish_reason is not None:
                self.finish_reasons[e.request.request_id].append(e.finish_reason)
        self.pool.check()
        return events

    def step(self):
        plan = self.schedule()
        return plan, self.finish_step(plan, self.worker.step(plan))

    def to_completion(self, max_steps=1000) -> list[StepPlan]:
        plans = []
        while self.scheduler.has_unfinished():
            plans.append(self.step()[0])
            assert len(plans) < max_steps, "no progress"
        return plans

    def scheduled(self, plan: StepPlan) -> dict[str, int]:
        return {c.seq_id: c.num_tokens for c in plan.scheduled}


def overlapped_to_completion(run: Run, max_steps=1000) -> tuple[int, int, int]:
    """Steps as WorkerLoop.run does with overlap_steps: while a plan is out, the next is planned
    and sent before the result of the one out is applied. The worker computes plans in order, so
    the LevelWorker computes each as it is sent. Returns (plans planned ahead, plans ahead that
    stopped short of pages, tokens computed for requests that had ended meanwhile)."""
    out, ahead_plans, blocked, discarded = deque(), 0, 0, 0
    while run.scheduler.has_unfinished() or out:
        for ahead in (False, True):
            if ahead != bool(out) or (ahead and run.scheduler.ahead_blocked):
                continue
            plan = run.scheduler.schedule(ahead)
            assert plan.num_tokens <= run.scheduler.config.max_batched_tokens
            run.pool.check()
            ahead_plans, blocked = ahead_plans + ahead, blocked + run.scheduler.ahead_blocked
            if not ahead or plan.scheduled or plan.dropped:
                out.append((plan, run.worker.step(plan)))
        plan, result = out.popleft()
        discarded += sum(t.seq_id not in run.scheduler.requests for t in result.tokens)
        run.finish_step(plan, result)
        max_steps -= 1
        assert max_steps > 0, "no progress"
    return ahead_plans, blocked, discarded


def assert_all_finished_in_full(run: Run) -> None:
    for rid, req in run.requests.items():
        assert req.status is Status.FINISHED
        assert req.output_token_ids == expected_output(req), rid
        assert run.streams[rid] == expected_output(req), rid  # no token lost or repeated in the stream
        assert run.finish_reasons[rid] == [FinishReason.LENGTH]
    assert run.pool.stats().used == 0
    assert not run.scheduler.running and not run.scheduler.waiting


# -- admission ---------------------------------------------------------------------------------


def test_higher_priority_is_admitted_first_and_ties_go_by_arrival():
    run = Run(max_num_seqs=3)
    run.add(
        make_request("low", [1, 2], priority=0, arrival=0.0),
        make_request("mid", [3, 4], priority=1, arrival=1.0),
        make_request("high_late", [5, 6], priority=5, arrival=3.0),
        make_request("high_early", [7, 8], priority=5, arrival=2.0),
    )
    plan, _ = run.step()
    assert [n.seq_id for n in plan.new] == ["high_early", "high_late", "mid"]
    assert run.scheduler.waiting == [run.requests["low"]]  # max_num_seqs reached
    run.to_completion()
    assert_all_finished_in_full(run)


def test_a_prefix_hit_is_admitted_with_its_cached_tokens_already_computed():
    run = Run(page_size=2)
    run.add(make_request("first", [1, 2, 3, 4, 5], max_new=1))
    run.to_completion()
    run.add(make_request("second", [1, 2, 3, 4, 9], max_new=2))
    plan, _ = run.step()
    [new] = plan.new
    assert new.num_computed_tokens == 4 and run.scheduled(plan) == {"second": 1}
    run.to_completion()
    assert_all_finished_in_full(run)


def prompt_tokens_computed(plans: list[StepPlan], run: Run) -> int:
    """Tokens the plans had the worker compute for prompts (not the decodes after them)."""
    done, total = {}, 0
    for plan in plans:
        for new in plan.new:
            done[new.seq_id] = new.num_computed_tokens
        for chunk in plan.scheduled:
            prompt = len(run.requests[chunk.seq_id].prompt_token_ids)
            total += max(0, min(done[chunk.seq_id] + chunk.num_tokens, prompt) - done[chunk.seq_id])
            done[chunk.seq_id] += chunk.num_tokens
    return total


def test_requests_arriving_with_one_system_prompt_compute_it_once_and_wait_for_its_pages():
    """Two requests with one 40-token system prompt, queued together, prefill chunked by the budget:
    the second waits while the first computes the shared pages, then takes them from the cache
    instead of computing them again; a request behind it with another prompt is not held up."""
    system = list(range(100, 140))
    run = Run(num_pages=64, page_size=4, max_batched_tokens=16, max_prefill_chunk=8, min_shared_wait_tokens=8)
    run.add(make_request("first", system + [1, 2, 3], arrival=0.0), make_request("second", system + [4, 5], arrival=1.0),
            make_request("other", [7, 7, 7], arrival=2.0))
    plans = [run.step()[0] for _ in range(6)]  # "first" prefills 8 tokens a step
    assert [[n.seq_id for n in p.new] for p in plans] == [["first", "other"], [], [], [], [], ["second"]]
    plans += run.to_completion()
    assert_all_finished_in_full(run)
    assert run.requests["second"].num_cached_prompt_tokens == 40  # every page of the system prompt
    assert prompt_tokens_computed(plans, run) == 43 + 2 + 3  # the system prompt once
    assert run.scheduler.num_deferred >= 1


def test_a_request_waiting_for_a_running_prompts_pages_is_not_refused_as_queued_too_long():
    system = list(range(100, 140))
    run = Run(num_pages=64, page_size=4, max_batched_tokens=16, max_prefill_chunk=8, max_num_seqs=2,
              min_shared_wait_tokens=8)
    run.add(make_request("first", system + [1], arrival=0.0), make_request("second", system + [2], arrival=1.0),
            make_request("beside", [8] * 20, arrival=2.0), make_request("queued", [9] * 30, arrival=3.0))
    for _ in range(3):  # "second" waits for "first"'s pages; "beside" takes the other slot; "queued" waits for one
        plan, _ = run.step()
        assert "second" not in run.scheduled(plan)
    events = run.scheduler.expire_waiting(max_wait_s=30.0, now=40.0)
    assert [e.request.request_id for e in events] == ["queued"]  # "second" is being served
    run.to_completion()
    assert run.requests["second"].num_cached_prompt_tokens == 40
    assert run.requests["second"].output_token_ids == expected_output(run.requests["second"])


def test_a_short_shared_head_is_computed_again_rather_than_waited_for():
    """Sharing fewer than min_shared_wait_tokens (a chat template's head) is not worth a step."""
    head = list(range(100, 108))  # two pages of 4
    run = Run(num_pages=64, page_size=4, max_batched_tokens=64, min_shared_wait_tokens=12)
    run.add(make_request("first", head + [1] * 20, arrival=0.0), make_request("second", head + [2] * 20, arrival=1.0))
    plan, _ = run.step()
    assert [n.seq_id for n in plan.new] == ["first", "second"] and run.scheduler.num_deferred == 0
    run.to_completion()
    assert_all_finished_in_full(run)


def test_a_request_waiting_for_anothers_pages_computes_them_itself_when_that_one_is_aborted():
    system = list(range(100, 140))
    run = Run(num_pages=64, page_size=4, max_batched_tokens=16, min_shared_wait_tokens=8)
    run.add(make_request("first", system + [1], arrival=0.0), make_request("second", system + [2], arrival=1.0))
    run.step()
    plan, _ = run.step()
    assert not plan.new and run.requests["second"].status is Status.WAITING
    run.scheduler.abort("first")  # 32 of its tokens computed: 8 pages cached
    plan, _ = run.step()
    assert [(n.seq_id, n.num_computed_tokens) for n in plan.new] == [("second", 32)]
    run.to_completion()
    assert run.requests["second"].output_token_ids == expected_output(run.requests["second"])
    assert run.pool.stats().used == 0 and not run.scheduler._computing


def shared_prompt_workload(seed: int) -> list[Request]:
    """Ten requests over three 12-token system prompts with their own 0..5 tokens, some ending on EOS."""
    rng = random.Random(seed)
    systems = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    requests = []
    for i in range(10):
        r = make_request(f"r{i}", rng.choice(systems) + [rng.randrange(50) for _ in range(rng.randrange(6))],
                         max_new=rng.randint(1, 6), priority=rng.randint(0, 1), arrival=float(i))
        if rng.random() < 0.3:
            r.eos_token_ids = (sampled_token(len(r.prompt_token_ids) + rng.randrange(r.stopping.max_new_tokens)),)
        requests.append(r)
    return requests


@pytest.mark.parametrize("num_pages", [14, 64])
def test_requests_waiting_for_shared_pages_finish_alike_in_turn_and_overlapped_through_preemption(num_pages):
    """Requests that wait for a running request's pages end with the stream they would have had,
    whether steps are taken in turn or overlapped, in pools small enough to preempt the request
    being waited for; every page is free at the end and nothing is left marked as computing."""
    deferred = preempted = 0
    for seed in range(25):
        streams = {}
        for overlapped in (False, True):
            run = Run(num_pages=num_pages, page_size=2, max_batched_tokens=6, min_shared_wait_tokens=4)
            run.add(*shared_prompt_workload(seed))
            if overlapped:
                overlapped_to_completion(run)
            else:
                run.to_completion()
            for rid, req in run.requests.items():
                assert run.streams[rid] == req.output_token_ids == ended_output(req), (seed, overlapped, rid)
            assert run.pool.stats().used == 0 and not run.scheduler.has_unfinished()
            assert not run.scheduler._computing
            deferred, preempted = deferred + run.scheduler.num_deferred, preempted + run.scheduler.num_preemptions
            streams[overlapped] = run.streams
        assert streams[True] == streams[False]
    assert deferred > 0 and (preempted > 0 or num_pages == 64), (deferred, preempted)


# -- the token budget ----------------------------------------------------------------------------


def test_a_long_prompt_is_chunked_within_the_budget_while_decodes_get_one_token_each_step():
    run = Run(max_batched_tokens=8)
    run.add(make_request("a", [1, 2], max_new=12, arrival=0.0), make_request("b", [3, 4], max_new=12, arrival=1.0))
    run.step()
    long_prompt = list(range(100, 130))
    run.add(make_request("long", long_prompt, max_new=2, arrival=2.0))
    chunks = []
    while not run.requests["long"].output_token_ids:
        plan, _ = run.step()
        scheduled = run.scheduled(plan)
        assert plan.num_tokens <= 8
        assert scheduled["a"] == 1 and scheduled["b"] == 1  # running decodes are never starved by the prefill
        chunks.append(scheduled["long"])
    assert chunks == [6, 6, 6, 6, 6]  # the prompt, in budget-sized chunks, sampled only when complete
    run.to_completion()
    assert_all_finished_in_full(run)


def test_no_step_carries_more_than_the_budget_under_load():
    run = Run(num_pages=64, max_batched_tokens=5)
    run.add(*[make_request(f"r{i}", range(10 * i, 10 * i + 3 + i), max_new=3, arrival=float(i)) for i in range(6)])
    plans = run.to_completion()
    assert max(p.num_tokens for p in plans) == 5
    assert_all_finished_in_full(run)


def test_under_a_backlog_running_requests_decode_first_in_one_step_of_backlog_decode_every():
    """With backlog_decode_every=2, while prompts wait the steps alternate: one gives the running
    decodes their token first, the next gives the waiting prompts the budget first (the decodes
    get what they leave). Every running request still decodes at least every other step, no step
    carries more than the budget, and once nothing waits every step decodes first again."""
    run = Run(max_batched_tokens=8, backlog_decode_every=2)
    run.add(make_request("a", [1, 2], max_new=30, arrival=0.0), make_request("b", [3, 4], max_new=30, arrival=1.0))
    run.step()  # a and b prefilled: from here on they decode
    run.add(*[make_request(f"p{i}", range(100 + 10 * i, 108 + 10 * i), max_new=1, arrival=2.0 + i) for i in range(8)])
    decoded = []
    while run.scheduler.waiting:
        plan, _ = run.step()
        scheduled = run.scheduled(plan)
        decoded.append(scheduled.get("a", 0) + scheduled.get("b", 0))
    # Prompts of 8 fill a prompts-first step; a decodes-first step gives a and b theirs, then 6 prompt tokens.
    assert len(decoded) >= 6 and decoded == [2, 0] * (len(decoded) // 2) + [2] * (len(decoded) % 2), decoded
    plan, _ = run.step()
    while run.scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids) for r in run.scheduler.running):
        plan, _ = run.step()
    plan, _ = run.step()
    assert run.scheduled(plan) == {"a": 1, "b": 1}  # no backlog: decodes first, every step
    run.to_completion()
    assert_all_finished_in_full(run)


def test_with_backlog_decode_every_one_running_requests_decode_first_in_every_step():
    run = Run(max_batched_tokens=8, backlog_decode_every=1)
    run.add(make_request("a", [1, 2], max_new=30, arrival=0.0), make_request("b", [3, 4], max_new=30, arrival=1.0))
    run.step()
    run.add(*[make_request(f"p{i}", range(100 + 10 * i, 108 + 10 * i), max_new=1, arrival=2.0 + i) for i in range(8)])
    steps = 0
    while run.scheduler.waiting:
        plan, _ = run.step()
        scheduled = run.scheduled(plan)
        assert scheduled["a"] == 1 and scheduled["b"] == 1
        steps += 1
    assert steps >= 6
    run.to_completion()
    assert_all_finished_in_full(run)


def test_a_prompts_first_step_still_decodes_with_what_the_prompts_leave():
    """A waiting prompt shorter than the budget leaves room: the running decodes take it in the
    same step, so giving prompts the budget first never leaves a step short."""
    run = Run(max_batched_tokens=8, backlog_decode_every=4)
    run.add(make_request("a", [1, 2], max_new=8, arrival=0.0), make_request("b", [3, 4], max_new=8, arrival=1.0))
    run.step()
    run.add(make_request("short", [5, 6, 7], max_new=2, arrival=2.0))
    plan, _ = run.step()
    assert run.scheduled(plan) == {"short": 3, "a": 1, "b": 1}
    run.to_completion()
    assert_all_finished_in_full(run)


def test_running_prompts_filling_prompts_first_steps_still_leave_every_other_step_to_the_decodes():
    """Prompts already admitted and still prefilling take a prompts-first step's whole budget, so
    the request waiting behind them is not admitted in it; the decodes still come first in every
    other step, not only once those prompts are done."""
    run = Run(num_pages=128, page_size=2, max_batched_tokens=8, max_prefill_chunk=4)
    run.add(make_request("a", [1, 2], max_new=30, arrival=0.0), make_request("b", [3, 4], max_new=30, arrival=1.0))
    run.step()
    run.add(make_request("long", list(range(200, 240)), max_new=2, arrival=2.0),
            make_request("other", list(range(300, 340)), max_new=2, arrival=3.0))
    run.step()  # both admitted, their first chunks
    run.add(make_request("behind", list(range(400, 410)), max_new=2, arrival=4.0))
    decoded = []
    while run.requests["behind"].status is Status.WAITING:
        plan, _ = run.step()
        scheduled = run.scheduled(plan)
        decoded.append(("a" in scheduled) + ("b" in scheduled))
    assert len(decoded) >= 6 and 0 in decoded, decoded  # the prompts did take steps first
    assert all(x or y for x, y in zip(decoded, decoded[1:])), decoded  # never two steps without decodes
    run.to_completion()
    assert_all_finished_in_full(run)


def test_with_no_room_to_admit_the_waiting_prompts_decodes_go_first():
    """Requests waiting for a free row (max_num_seqs) are no backlog a prompts-first step could
    serve: the running requests decode first in every step."""
    run = Run(max_batched_tokens=8, max_num_seqs=2, backlog_decode_every=2)
    run.add(make_request("a", [1, 2], max_new=6, arrival=0.0), make_request("b", [3, 4], max_new=6, arrival=1.0))
    run.step()
    run.add(make_request("waits", list(range(100, 108)), max_new=2, arrival=2.0))
    for _ in range(4):
        plan, _ = run.step()
        assert run.scheduled(plan) == {"a": 1, "b": 1}
    run.to_completion()
    assert_all_finished_in_full(run)


def test_backlog_decode_every_must_be_at_least_one():
    with pytest.raises(ValueError, match="backlog_decode_every must be >= 1"):
        SchedulerConfig(backlog_decode_every=0)


# -- preemption ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy, priorities, victim",
    [
        ("newest", {"A": 0, "B": 2, "C": 1}, "C"),  # last admitted
        ("priority", {"A": 0, "B": 2, "C": 1}, "A"),  # lowest priority
        ("priority", {"A": 1, "B": 2, "C": 1}, "C"),  # lowest priority, newest on a tie
        ("size", {"A": 0, "B": 2, "C": 1}, "B"),  # most computed tokens
    ],
)
def test_each_victim_policy_preempts_the_request_it_names_when_pages_run_out(policy, priorities, victim):
    # 7 pages of 2 tokens. A (2-token prompt) runs alone first; then B (6 tokens) and C (2 tokens)
    # join, so the running order is A, B, C and A has 3 computed tokens, B 6 and C 2. In the next
    # step A fits its page, B takes the last free page and C finds none.
    run = Run(num_pages=7, page_size=2, victim_policy=policy)
    run.add(make_request("A", [1, 2], max_new=4, priority=priorities["A"], arrival=0.0))
    run.step()
    run.add(
        make_request("B", range(10, 16), max_new=4, priority=priorities["B"], arrival=1.0),
        make_request("C", [20, 21], max_new=4, priority=priorities["C"], arrival=2.0),
    )
    plan, _ = run.step()
    assert [n.seq_id for n in plan.new] == ["B", "C"]
    assert [r.num_computed_tokens for r in run.scheduler.running] == [3, 6, 2]

    plan, _ = run.step()
    assert plan.dropped == [victim]
    assert victim not in run.scheduled(plan) and not plan.new
    assert run.requests[victim].status is Status.WAITING and run.requests[victim].num_preemptions == 1
    assert run.scheduler.num_preemptions == 1
    assert set(run.scheduled(plan)) == {"A", "B", "C"} - {victim}

    run.to_completion()
    assert_all_finished_in_full(run)  # the victim resumes where it stopped and finishes in full


def random_workload(seed: int) -> list[Request]:
    """Eight requests with prompts over a tiny alphabet (so they share prefixes), mixed lengths and priorities."""
    rng = random.Random(seed)
    return [
        make_request(
            f"r{i}",
            [rng.choice([7, 8]) for _ in range(rng.randint(1, 14))],
            max_new=rng.randint(1, 6),
            priority=rng.randint(0, 2),
            arrival=float(i),
        )
        for i in range(8)
    ]


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("policy", ["newest", "priority", "size"])
def test_busy_small_pools_preempt_within_the_budget_and_still_finish_every_request_in_full(policy, every):
    preemptions = 0
    for seed in range(20):
        run = Run(num_pages=12, page_size=2, max_batched_tokens=5, victim_policy=policy, backlog_decode_every=every)
        run.add(*random_workload(seed))
        run.to_completion()  # checks the budget and the page accounting at every step
        assert_all_finished_in_full(run)
        preemptions += run.scheduler.num_preemptions
    assert preemptions > 0


# -- finishing and aborting ----------------------------------------------------------------------


def test_a_finished_request_frees_its_pages_in_the_same_step_and_is_dropped_in_the_next_plan():
    run = Run(num_pages=16, page_size=2)
    run.add(make_request("short", [1, 2, 3, 4], max_new=1), make_request("long", [5, 6, 7, 8], max_new=5))
    _, events = run.step()
    assert {e.request.request_id: e.finish_reason for e in events} == {"short": FinishReason.LENGTH, "long": None}
    stats = run.pool.stats()
    assert stats.used == len(run.pool.page_table("long")) == 2  # right after update, before any schedule
    assert stats.cached == 2  # short's two full prompt pages stay reusable
    plan = run.schedule()
    assert plan.dropped == ["short"] and "short" not in run.scheduled(plan)
    run.finish_step(plan, run.worker.step(plan))
    run.to_completion()
    assert_all_finished_in_full(run)


def test_aborting_a_waiting_request_ends_it_without_the_worker_ever_seeing_it():
    run = Run()
    run.add(make_request("r", [1, 2, 3]))
    event = run.scheduler.abort("r")
    assert (event.token_id, event.finish_reason) == (None, FinishReason.CANCELLED)
    assert run.requests["r"].status is Status.FINISHED
    assert not run.scheduler.has_unfinished()
    plan = run.schedule()
    assert plan.dropped == [] and plan.scheduled == [] and plan.new == []
    assert run.pool.stats().free == run.pool.num_pages
    assert run.scheduler.abort("r") is None


def test_aborting_a_running_request_frees_its_pages_and_drops_it_next_step():
    run = Run()
    run.add(make_request("r", [1, 2, 3], max_new=5), make_request("other", [4, 5, 6], max_new=3))
    run.step()
    event = run.scheduler.abort("r")
    assert event.finish_reason is FinishReason.CANCELLED
    assert run.pool.stats().used == len(run.pool.page_table("other"))
    plan, _ = run.step()
    assert plan.dropped == ["r"] and set(run.scheduled(plan)) == {"other"}
    run.to_completion()
    assert run.requests["other"].output_token_ids == expected_output(run.requests["other"])
    assert run.pool.stats().used == 0


def test_aborting_while_a_step_runs_discards_that_steps_token():
    run = Run()
    run.add(make_request("r", [1, 2, 3], max_new=5), make_request("other", [4, 5, 6], max_new=3))
    plan = run.schedule()
    result = run.worker.step(plan)
    run.scheduler.abort("r")
    events = run.finish_step(plan, result)
    assert [e.request.request_id for e in events] == ["other"]
    assert run.requests["r"].output_token_ids == []
    assert run.pool.stats().used == len(run.pool.page_table("other"))
    run.to_completion()
    assert run.pool.stats().used == 0


def test_a_preempted_request_can_be_aborted_while_it_waits():
    run = Run(num_pages=7, page_size=2, victim_policy="newest")
    run.add(make_request("A", [1, 2], max_new=4, arrival=0.0))
    run.step()
    run.add(
        make_request("B", range(10, 16), max_new=4, arrival=1.0),
        make_request("C", [20, 21], max_new=4, arrival=2.0),
    )
    run.step()
    run.step()  # C is preempted (see the victim test)
    assert run.requests["C"].status is Status.WAITING
    assert run.scheduler.abort("C").finish_reason is FinishReason.CANCELLED
    plan, _ = run.step()
    assert "C" not in plan.dropped  # the worker forgot it when it was preempted
    run.to_completion()
    assert run.requests["C"].finish_reason is FinishReason.CANCELLED
    for rid in "AB":
        assert run.requests[rid].output_token_ids == expected_output(run.requests[rid])
    assert run.pool.stats().used == 0


# -- latency under load: aging, static batching, queue wait, admission by sequence length --------


def test_an_aged_low_priority_request_is_admitted_before_newer_high_priority_ones():
    # aging_s=10: a request gains a priority point per 10 s waited. "old" (priority 0, arrived at
    # t=0) outranks "new" (priority 2, arrived at t=25) since 0 + 25/10 > 2, but not "newer"
    # (priority 2, arrived at t=15): 2.5 - 1.5 ... 0 + 15/10 < 2.
    run = Run(num_pages=64, page_size=2, max_num_seqs=1, aging_s=10.0)
    run.add(make_request("newer", [1, 2], priority=2, arrival=15.0),
            make_request("old", [3, 4], priority=0, arrival=0.0),
            make_request("new", [5, 6], priority=2, arrival=25.0))
    order = []
    for plan in run.to_completion():
        order += [n.seq_id for n in plan.new]
    assert order == ["newer", "old", "new"]
    assert_all_finished_in_full(run)


def test_without_aging_priority_alone_orders_admission():
    run = Run(num_pages=64, page_size=2, max_num_seqs=1, aging_s=0.0)
    run.add(make_request("old", [3, 4], priority=0, arrival=0.0), make_request("new", [5, 6], priority=2, arrival=1e6))
    order = [n.seq_id for plan in run.to_completion() for n in plan.new]
    assert order == ["new", "old"]


def test_static_batching_admits_the_next_batch_only_after_the_whole_batch_finishes():
    run = Run(num_pages=64, page_size=2, max_num_seqs=2, batching="static")
    run.add(make_request("short", [1, 2], max_new=1, arrival=0.0), make_request("long", [3, 4], max_new=6, arrival=1.0),
            make_request("next", [5, 6], max_new=2, arrival=2.0))
    plans = run.to_completion()
    admitted_at = {n.seq_id: i for i, plan in enumerate(plans) for n in plan.new}
    finished_long = max(i for i, plan in enumerate(plans) if "long" in run.scheduled(plan))
    assert admitted_at["short"] == admitted_at["long"] == 0
    assert admitted_at["next"] == finished_long + 1  # a free slot since "short" ended was left empty
    assert_all_finished_in_full(run)


def test_a_static_batch_fills_to_max_num_seqs_even_when_one_step_cannot_prefill_it():
    # Prompts of 10 tokens, 16 tokens a step: one step's budget starts two; the batch of four
    # fills over the next steps, and the fifth request waits for the whole batch to end.
    run = Run(num_pages=200, page_size=4, max_num_seqs=4, max_batched_tokens=16, batching="static")
    run.add(*[make_request(f"r{i}", range(100 * i, 100 * i + 10), max_new=3 + i, arrival=float(i)) for i in range(5)])
    plans = run.to_completion()
    admitted_at = {n.seq_id: i for i, plan in enumerate(plans) for n in plan.new}
    assert sorted(admitted_at[f"r{i}"] for i in range(4)) == [0, 0, 1, 1]  # r3 starts with one token of budget
    last_of_batch = max(i for i, plan in enumerate(plans) if "r3" in run.scheduled(plan))
    assert admitted_at["r4"] == last_of_batch + 1
    assert_all_finished_in_full(run)


@pytest.mark.parametrize("batching", ["static", "static-unpadded"])
def test_finished_rows_of_a_static_batch_keep_decoding_only_when_padded(batching):
    run = Run(num_pages=64, page_size=2, max_num_seqs=2, batching=batching)
    run.add(make_request("short", [1, 2], max_new=1, arrival=0.0), make_request("long", [3, 4], max_new=6, arrival=1.0))
    plans = run.to_completion()
    long_steps = [i for i, plan in enumerate(plans) if "long" in run.scheduled(plan)]
    short_steps = [i for i, plan in enumerate(plans) if "short" in run.scheduled(plan)]
    if batching == "static":  # a row of a fixed-shape batch: computed in every step of the batch
        assert short_steps == long_steps
    else:
        assert short_steps == [0]
    assert not run.scheduler.padding
    assert_all_finished_in_full(run)  # the client saw only its own tokens; every page came back
    dropped = [seq for plan in [*plans, run.scheduler.schedule()] for seq in plan.dropped]
    assert dropped.count("short") == 1  # the worker is told once to forget it, padded or not


def test_padding_rows_give_their_pages_to_requests_and_stop_at_the_models_context():
    # 7 pages of 2 tokens: "long" needs all of them by its end, so the padding row of "short"
    # must give way instead of preempting anyone.
    run = Run(num_pages=7, page_size=2, max_num_seqs=2, batching="static")
    run.add(make_request("short", [1, 2], max_new=1, arrival=0.0), make_request("long", [3, 4], max_new=11, arrival=1.0))
    plans = run.to_completion()
    short_steps = [i for i, plan in enumerate(plans) if "short" in run.scheduled(plan)]
    assert 1 < len(short_steps) < len(plans)  # it padded for a while, then gave its pages up
    assert run.scheduler.num_preemptions == 0 and not run.scheduler.padding
    assert_all_finished_in_full(run)

    capped = Run(num_pages=64, page_size=2, max_num_seqs=2, batching="static")
    capped.scheduler.max_context = 5
    capped.add(make_request("short", [1, 2, 3, 4], max_new=1, arrival=0.0), make_request("long", [5, 6], max_new=3, arrival=1.0))
    for _ in range(2):
        capped.step()
    assert capped.scheduler.padding == {"short": 5}  # its prompt, its token and one padding token: the context
    plan, _ = capped.step()
    assert plan.dropped == ["short"]
    assert "short" not in capped.scheduled(plan) and not capped.scheduler.padding
    capped.to_completion()
    assert_all_finished_in_full(capped)


def test_requests_waiting_too_long_are_refused_for_load_and_free_nothing_they_never_held():
    run = Run(num_pages=64, page_size=2, max_num_seqs=1)
    run.add(make_request("running", [1, 2], max_new=5, arrival=0.0), make_request("stuck", [3, 4], arrival=1.0))
    run.step()
    events = run.scheduler.expire_waiting(max_wait_s=30.0, now=40.0)
    assert [(e.request.request_id, e.finish_reason, e.refused) for e in events] == [("stuck", FinishReason.CANCELLED, True)]
    assert "39.0 s in the queue" in events[0].message and "30 s (max_queue_wait_s)" in events[0].message
    assert run.scheduler.expire_waiting(max_wait_s=30.0, now=40.0) == []  # the running one is not touched
    run.to_completion()
    assert run.requests["running"].finish_reason is FinishReason.LENGTH and run.pool.stats().used == 0


def test_a_flood_of_long_prompts_waits_for_room_instead_of_thrashing():
    # 20 pages of 4 tokens; prompts of 30 tokens (8 pages each), a budget of 64 tokens a step.
    # Admitting by the first chunk alone would start a third prompt with the budget's last 4
    # tokens and preempt when it grows; admission by whole prompt starts two at a time.
    run = Run(num_pages=20, page_size=4, max_batched_tokens=64)
    run.add(*[make_request(f"r{i}", range(100 * i, 100 * i + 30), max_new=3, arrival=float(i)) for i in range(6)])
    plans = run.to_completion()
    assert max(len({c.seq_id for c in p.scheduled}) for p in plans) <= 2
    assert run.scheduler.num_preemptions == 0
    assert_all_finished_in_full(run)


def test_a_prefill_chunk_cap_lets_a_short_request_start_beside_a_long_prompt():
    run = Run(num_pages=256, page_size=4, max_batched_tokens=16, max_prefill_chunk=8)
    run.add(make_request("long", range(200, 260), max_new=2, arrival=0.0))
    run.step()
    run.add(make_request("short", [1, 2, 3], max_new=2, arrival=1.0))
    plan, _ = run.step()
    assert run.scheduled(plan) == {"long": 8, "short": 3}  # without the cap, "long" would take all 16
    run.to_completion()
    assert_all_finished_in_full(run)


def test_the_requests_ahead_of_a_newcomer_are_those_admission_takes_before_it():
    scheduler = Scheduler(PagePool(num_pages=64, page_size=2), SchedulerConfig(aging_s=10.0))
    for request in (make_request("low", [1], priority=0, arrival=0.0), make_request("high", [2], priority=5, arrival=1.0),
                    make_request("low-late", [3], priority=0, arrival=2.0)):
        scheduler.add(request)
    ahead = lambda newcomer: [r.request_id for r in scheduler.waiting_ahead_of(newcomer)]  # noqa: E731
    assert ahead(make_request("new", [4], priority=0, arrival=3.0)) == ["high", "low", "low-late"]
    assert ahead(make_request("urgent", [4], priority=9, arrival=3.0)) == []
    # Aging (a point per 10 s): priority 2 arriving at 21 s ranks as priority 0 arriving at 1 s.
    assert ahead(make_request("mid", [4], priority=2, arrival=21.0)) == ["high", "low"]


# -- overlapped steps ----------------------------------------------------------------------------


def eos_workload(seed: int) -> list[Request]:
    """random_workload's requests, half of them ending on an EOS sampled before max_new_tokens."""
    rng = random.Random(seed)
    requests = random_workload(seed)
    for r in requests:
        r.stopping = StoppingParams(max_new_tokens=r.stopping.max_new_tokens + 3)
        if rng.random() < 0.5:
            r.eos_token_ids = (sampled_token(len(r.prompt_token_ids) + rng.randrange(r.stopping.max_new_tokens)),)
    return requests


def ended_output(request: Request) -> list[int]:
    """expected_output up to its EOS, if it samples one."""
    full = expected_output(request)
    ends = [i for i, t in enumerate(full) if t in request.eos_token_ids]
    return full[:ends[0] + 1] if ends else full


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("policy", ["newest", "size"])
def test_overlapped_steps_stream_what_steps_in_turn_stream_and_free_every_page(policy, every):
    """Plans made while a step is out give every request the output steps taken one at a time
    give it, through preemption (pages run short), EOS found after the next plan went out, and
    pages too few to plan ahead; every page is free at the end."""
    totals = [0, 0, 0]
    for seed in range(30):
        streams = {}
        for overlapped in (False, True):
            run = Run(num_pages=12, page_size=2, max_batched_tokens=5, victim_policy=policy,
                      backlog_decode_every=every)
            run.add(*eos_workload(seed))
            if overlapped:
                totals = [a + b for a, b in zip(totals, overlapped_to_completion(run))]
            else:
                run.to_completion()
            for rid, req in run.requests.items():
                assert run.streams[rid] == req.output_token_ids == ended_output(req), (seed, overlapped, rid)
                eos = req.output_token_ids[-1] in req.eos_token_ids
                assert run.finish_reasons[rid] == [FinishReason.EOS if eos else FinishReason.LENGTH]
            assert run.pool.stats().used == 0 and not run.scheduler.has_unfinished()
            assert all(r.num_inflight_tokens == 0 for r in run.requests.values())
            streams[overlapped] = run.streams
        assert streams[True] == streams[False]
    ahead_plans, blocked, discarded = totals
    # Plans were made ahead, some stopped short of pages (then the next waited and preempted),
    # and some requests that ended on EOS had a token computed after it, discarded.
    assert ahead_plans > 100 and blocked > 0 and discarded > 0, totals


def test_a_request_whose_last_token_by_length_is_out_is_not_planned_again():
    run = Run(num_pages=64, page_size=2)
    run.add(make_request("one", [1, 2, 3], max_new=1), make_request("three", [4, 5], max_new=3))
    ahead_plans, _, discarded = overlapped_to_completion(run)
    assert_all_finished_in_full(run)
    assert ahead_plans > 0 and discarded == 0  # nothing computed past max_new_tokens
    assert {k: len(v.token_ids) for k, v in run.worker.seqs.items()} == {"three": 2 + 3}  # not dropped yet: no plan since


def test_a_request_aborted_while_two_plans_are_out_frees_its_pages_and_the_rest_finish():
    run = Run(num_pages=64, page_size=2)
    run.add(make_request("r", [1, 2, 3], max_new=6), make_request("other", [4, 5, 6], max_new=6))
    first = run.scheduler.schedule()
    out = deque([(first, run.worker.step(first))])
    second = run.scheduler.schedule(ahead=True)
    assert set(run.scheduled(second)) == {"r", "other"}  # both decode the tokens the first step samples
    out.append((second, run.worker.step(second)))
    run.scheduler.abort("r")
    assert run.pool.stats().used == len(run.pool.page_table("other"))
    while out:
        run.finish_step(*out.popleft())
    plan = run.schedule()
    assert plan.dropped == ["r"] and set(run.scheduled(plan)) == {"other"}
    run.finish_step(plan, run.worker.step(plan))
    overlapped_to_completion(run)
    assert run.requests["other"].output_token_ids == expected_output(run.requests["other"])
    assert run.requests["r"].output_token_ids == [] and run.pool.stats().used == 0


def test_static_batches_are_not_planned_ahead():
    run = Run(batching="static")
    with pytest.raises(ValueError, match="continuous batching only"):
        run.scheduler.schedule(ahead=True)
