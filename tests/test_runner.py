"""The worker core trusts no plan: a sequence it cannot take, run or sample fails alone, with its
reason, and every other sequence of the step gets the token transformers would give it."""

import random
import sys

import pytest
import torch

from kvmesh.params import SamplingParams
from kvmesh.services.worker.model import CausalLM
from kvmesh.services.worker.runner import KVPool, ModelRunner
from kvmesh.step import NewSequence, ScheduledChunk, StepPlan
from reference import assert_matches_reference, hf_greedy

GREEDY = SamplingParams(temperature=0.0)
PAGE = 16
STEPS = 8


def prompt(seed: int, length: int = 20, avoid: int | None = None) -> list[int]:
    rng = random.Random(seed)
    return [t for t in (rng.randrange(3, 512) for _ in range(length * 2)) if t != avoid][:length]


def pages_of(i: int, n: int = 4) -> list[int]:
    return list(range(i * n, (i + 1) * n))  # 4 pages: 64 tokens, room for the prompt and STEPS tokens


def run(runner: ModelRunner, plan: StepPlan, steps: int) -> tuple[dict[str, list], dict[str, list], dict[str, str]]:
    """Runs `plan`, then `steps - 1` decode steps of whatever still runs: tokens, logprobs, failures per sequence."""
    tokens, logprobs, failed = {}, {}, {}
    for _ in range(steps):
        result = runner.step(plan)
        failed.update(result.failed)
        for t in result.tokens:
            tokens.setdefault(t.seq_id, []).append(t.token_id)
            logprobs.setdefault(t.seq_id, []).append(t.logprob)
        plan = StepPlan(scheduled=[ScheduledChunk(s, 1) for s in tokens if s not in failed])
    return tokens, logprobs, failed


def test_a_sequence_whose_sampling_fails_is_reported_failed_and_the_others_get_their_tokens(hf_checkpoint):
    """One sequence's forward pass overflows (a poisoned embedding row stands in for any numeric
    blow-up): its logits are NaN, so neither a draw nor argmax means anything. It alone fails;
    the greedy neighbour matches transformers and the seeded one draws what it draws alone."""
    model_dir = hf_checkpoint("llama")
    poisoned_token = 7
    model = CausalLM.load(model_dir)
    model.embed[poisoned_token] = float("nan")
    good, seeded = prompt(1, avoid=poisoned_token), prompt(2, avoid=poisoned_token)
    bad = prompt(3)[:10] + [poisoned_token] + prompt(3)[10:]
    reference = hf_greedy(model_dir, good, STEPS)
    assert poisoned_token not in reference.token_ids  # else the healthy sequence would meet the poison too
    sampled = SamplingParams(temperature=0.8, top_k=50, seed=11)
    runner = ModelRunner(model, num_pages=16, page_size=PAGE)
    plan = StepPlan(new=[NewSequence("good", good, len(good), GREEDY, pages_of(0)),
                         NewSequence("bad", bad, len(bad), SamplingParams(temperature=1.0, seed=5), pages_of(1)),
                         NewSequence("seeded", seeded, len(seeded), sampled, pages_of(2))],
                    scheduled=[ScheduledChunk(s, n) for s, n in (("good", len(good)), ("bad", len(bad)),
                                                                  ("seeded", len(seeded)))])
    tokens, logprobs, failed = run(runner, plan, STEPS)

    assert list(failed) == ["bad"] and "not finite" in failed["bad"]
    assert "bad" not in tokens and "bad" not in runner.seqs  # forgotten at once
    assert assert_matches_reference(tokens["good"], logprobs["good"], reference) >= 4
    alone = ModelRunner(model, num_pages=16, page_size=PAGE)
    alone_tokens, _, _ = run(alone, StepPlan(new=[NewSequence("seeded", seeded, len(seeded), sampled, pages_of(2))],
                                             scheduled=[ScheduledChunk("seeded", len(seeded))]), STEPS)
    assert tokens["seeded"] == alone_tokens["seeded"] and len(tokens["seeded"]) == STEPS


@pytest.mark.parametrize("new, field", [
    (NewSequence("x", [5, 999_999, 6], 3, GREEDY, [8]), "token id 999999 is outside the vocabulary [0, 512)"),
    (NewSequence("x", [5, 6, 7], 3, GREEDY, [10_000]), "page 10000 is outside the pool [0, 16)"),
    (NewSequence("x", [5, 6, 7], 3, SamplingParams(temperature=float("nan")), [8]), "temperature: must be in [0, 100]"),
    (NewSequence("x", [5, 6, 7], 3, SamplingParams(repetition_penalty=1e-45), [8]), "repetition_penalty: must be in [0.01, 2]"),
    (NewSequence("x", [5, 6, 7], 9, GREEDY, [8]), "num_prompt_tokens: must be in [1, 3]"),
    (NewSequence("x", [5] * 600, 600, GREEDY, [8]), "over the model's context of 512"),
])
def test_a_new_sequence_outside_the_workers_limits_fails_alone_naming_the_field(hf_checkpoint, new, field):
    model_dir = hf_checkpoint("llama")
    runner = ModelRunner(CausalLM.load(model_dir), num_pages=16, page_size=PAGE)
    good = prompt(4)
    plan = StepPlan(new=[NewSequence("good", good, len(good), GREEDY, pages_of(0)), new],
                    scheduled=[ScheduledChunk("good", len(good)), ScheduledChunk("x", 3)])
    tokens, logprobs, failed = run(runner, plan, 4)
    assert list(failed) == ["x"] and field in failed["x"], failed
    assert assert_matches_reference(tokens["good"], logprobs["good"], hf_greedy(model_dir, good, 4)) >= 2


@pytest.mark.parametrize("chunk, why", [
    (ScheduledChunk("ghost", 1), "unknown to the worker"),
    (ScheduledChunk("x", 1, [99]), "page 99 is outside the pool"),
    (ScheduledChunk("x", 5), "do not lie within its 3 tokens"),
    (ScheduledChunk("x", 3, []), "do not fit its 0 pages"),
])
def test_a_chunk_the_worker_cannot_run_fails_its_sequence_alone(hf_checkpoint, chunk, why):
    model_dir = hf_checkpoint("llama")
    runner = ModelRunner(CausalLM.load(model_dir), num_pages=16, page_size=PAGE)
    good = prompt(5)
    x_pages = [] if "0 pages" in why else [8]
    plan = StepPlan(new=[NewSequence("good", good, len(good), GREEDY, pages_of(0)),
                         NewSequence("x", [5, 6, 7], 3, GREEDY, x_pages)],
                    scheduled=[ScheduledChunk("good", len(good)), chunk])
    result = runner.step(plan)
    assert list(result.failed) == [chunk.seq_id] and why in result.failed[chunk.seq_id], result.failed
    [token] = result.tokens
    assert token.seq_id == "good" and token.token_id == hf_greedy(model_dir, good, 1).token_ids[0]


def test_a_sequence_scheduled_twice_in_one_step_fails_and_the_step_goes_on(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    runner = ModelRunner(CausalLM.load(model_dir), num_pages=16, page_size=PAGE)
    good, twice = prompt(6), prompt(7)
    plan = StepPlan(new=[NewSequence("good", good, len(good), GREEDY, pages_of(0)),
                         NewSequence("twice", twice, len(twice), GREEDY, pages_of(1))],
                    scheduled=[ScheduledChunk("twice", 10), ScheduledChunk("good", len(good)), ScheduledChunk("twice", 10)])
    result = runner.step(plan)
    assert result.failed == {"twice": "scheduled twice in one step"}
    assert [t.seq_id for t in result.tokens] == ["good"]
    assert torch.isfinite(torch.tensor([t.logprob for t in result.tokens])).all()


def test_the_engine_ends_a_sequence_that_failed_alone_with_an_error_and_returns_its_pages(hf_checkpoint):
    from kvmesh.engine import EngineConfig, LLMEngine
    from kvmesh.params import StoppingParams
    from kvmesh.services.scheduler.request import FinishReason

    model_dir = hf_checkpoint("llama")
    engine = LLMEngine(EngineConfig(model=model_dir, num_pages=32))
    engine.model.embed[7] = float("nan")
    good = prompt(8, avoid=7)
    reference = hf_greedy(model_dir, good, STEPS)
    assert 7 not in reference.token_ids
    stop = StoppingParams(max_new_tokens=STEPS, ignore_eos=True)
    ok = engine.add_request(good, GREEDY, stop)
    bad = engine.add_request(prompt(9)[:5] + [7] + prompt(9)[5:], GREEDY, stop)
    events = []
    while engine.has_unfinished():
        events += engine.step()
    [failure] = [e for e in events if e.request is bad]
    assert bad.finish_reason is FinishReason.ERROR and "not finite" in failure.message and bad.output_token_ids == []
    assert ok.finish_reason is FinishReason.LENGTH
    assert assert_matches_reference(ok.output_token_ids, ok.output_logprobs, reference) >= 4
    assert engine.page_stats().used == 0


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) << 10


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_populating_the_pool_backs_it_with_memory_and_leaves_its_contents(hf_checkpoint):
    """The served worker backs its CPU pool with memory in the background while steps write it:
    afterwards the pool is resident and what was written before, and between chunks, is unchanged."""
    model = CausalLM.load(hf_checkpoint("llama"))
    pool = KVPool(model, KVPool.pages_for_budget(model, 64 << 20, 16), 16)
    pool.k[0, 5] = 1.25  # written before: lowest pages, the first chunk
    pool.v[-1, -1] = -3.5  # the last layer's last slot: the buffer's last page
    pool.k[1, 16 * 40 + 3] = 7.0  # a page between the chunks of 32 pages below
    before = _rss_bytes()
    why = pool.populate(pages_per_chunk=32)
    if why is not None and "MADV_POPULATE_WRITE" in why:
        pytest.skip(why)
    assert why is None
    assert _rss_bytes() - before > 0.9 * pool.nbytes  # the pool (less the pages written above) is resident now
    assert pool.k[0, 5].eq(1.25).all() and pool.v[-1, -1].eq(-3.5).all() and pool.k[1, 16 * 40 + 3].eq(7.0).all()
    assert int(pool.k.ne(0).sum()) == pool.k[0, 5].numel() * 2 and int(pool.v.ne(0).sum()) == pool.v[-1, -1].numel()


def test_a_pool_larger_than_the_free_memory_is_left_to_be_mapped_as_written(hf_checkpoint, monkeypatch):
    """A pool set larger than the machine can hold is not taken at start: populating stops before
    the available memory falls under an eighth of the total, and says so."""
    import psutil

    model = CausalLM.load(hf_checkpoint("llama"))
    pool = KVPool(model, KVPool.pages_for_budget(model, 64 << 20, 16), 16)
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=real.total // 8))
    before = _rss_bytes()
    why = pool.populate(pages_per_chunk=32)
    assert why is not None and why.startswith("stopped at 0 MiB of 64:") and "available memory" in why
    assert _rss_bytes() - before < pool.nbytes // 4
