"""The in-process engine against transformers: same tokens, whatever the batch, preemption or cache."""

import random

import pytest
import torch

from kvmesh.engine import EngineConfig, LLMEngine
from kvmesh.params import InvalidRequest, SamplingParams, StoppingParams
from kvmesh.services.scheduler.core import SchedulerConfig
from kvmesh.services.scheduler.request import FinishReason
from kvmesh.kernels.attention import SequenceSlice
from kvmesh.kernels.linear import onednn_rows
from kvmesh.services.worker.model import BatchInput, CausalLM
from kvmesh.services.worker.runner import ModelRunner
from reference import assert_matches_reference, hf_greedy

GREEDY = SamplingParams(temperature=0.0)
ARCHS = ["llama", "mistral", "qwen2"]


def random_prompts(n: int, lengths: tuple[int, int], seed: int, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def run_staggered(engine: LLMEngine, prompts, stopping, sampling=GREEDY, every: int = 3):
    """Adds one prompt every `every` steps, so requests join a batch that is already running.
    `sampling` is one SamplingParams for all, or one per prompt."""
    samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    reqs, pending, steps = [], list(zip(prompts, samplings)), 0
    while pending or engine.has_unfinished():
        if pending and steps % every == 0:
            prompt, params = pending.pop(0)
            reqs.append(engine.add_request(prompt, params, stopping))
        engine.step()
        steps += 1
    return reqs


def assert_all_pages_returned(engine: LLMEngine) -> None:
    stats = engine.page_stats()
    assert stats.used == 0 and stats.free + stats.cached == stats.total, stats
    engine.pool.check()


@pytest.mark.parametrize("arch", ARCHS)
def test_one_prompt_greedy_matches_transformers(hf_checkpoint, arch):
    model_dir = hf_checkpoint(arch)
    engine = LLMEngine(EngineConfig(model=model_dir, num_pages=64))
    prompt = random_prompts(1, (20, 20), seed=1)[0]
    [done] = engine.generate([prompt], GREEDY, StoppingParams(max_new_tokens=24, ignore_eos=True))
    assert done.finish_reason is FinishReason.LENGTH
    assert assert_matches_reference(done.token_ids, done.logprobs, hf_greedy(model_dir, prompt, 24)) > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_staggered_batch_of_eight_matches_transformers(hf_checkpoint, arch):
    model_dir = hf_checkpoint(arch)
    # A small token budget forces the long prompts (over 3 pages) to prefill in chunks beside decodes.
    engine = LLMEngine(EngineConfig(model=model_dir, num_pages=128, scheduler=SchedulerConfig(max_batched_tokens=40)))
    prompts = random_prompts(8, (5, 90), seed=2)
    assert sum(len(p) > 48 for p in prompts) >= 2
    stop = StoppingParams(max_new_tokens=16, ignore_eos=True)
    reqs = run_staggered(engine, prompts, stop)
    for prompt, req in zip(prompts, reqs):
        assert_matches_reference(req.output_token_ids, req.output_logprobs, hf_greedy(model_dir, prompt, 16))
    assert_all_pages_returned(engine)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(12, 4, 64), (20, 4, 16)])
def test_wide_attention_matches_transformers_in_a_staggered_batch(hf_checkpoint, heads, kv_heads, head_dim):
    """The decode kernel's page-at-a-time float32 path, taken by models of eight query heads or more
    (the benchmark model's 12 over 4 of 64; 20 heads are a batch of 16 and one of 4), against
    transformers in a batch that decodes beside prefill chunks."""
    model_dir = hf_checkpoint("llama", hidden_size=heads * head_dim, num_attention_heads=heads,
                              num_key_value_heads=kv_heads, intermediate_size=256)
    engine = LLMEngine(EngineConfig(model=model_dir, num_pages=128, scheduler=SchedulerConfig(max_batched_tokens=40)))
    prompts = random_prompts(6, (5, 90), seed=12)
    reqs = run_staggered(engine, prompts, StoppingParams(max_new_tokens=16, ignore_eos=True))
    compared = sum(assert_matches_reference(req.output_token_ids, req.output_logprobs, hf_greedy(model_dir, prompt, 16))
                   for prompt, req in zip(prompts, reqs))
    assert compared >= 48, compared
    assert_all_pages_returned(engine)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(12, 4, 64), (4, 2, 16), (8, 8, 128)])
def test_long_contexts_match_transformers(hf_checkpoint, heads, kv_heads, head_dim):
    """The decode kernel cuts a context past 1,024 tokens into chunks of 1,024 and merges their
    softmaxes: sequences that decode across the first cut and the second, beside a short one,
    against transformers (both float32 paths: eight query heads or more, and fewer). With 8 KV
    heads of 128 the 2,040-token prompt's K and V pass 8 MiB, which the prefill kernel computes in
    tall tiles."""
    model_dir = hf_checkpoint("llama", hidden_size=heads * head_dim, num_attention_heads=heads,
                              num_key_value_heads=kv_heads, intermediate_size=128, max_position_embeddings=4096)
    engine = LLMEngine(EngineConfig(model=model_dir, num_pages=320))
    prompts = [random_prompts(1, (n, n), seed=n)[0] for n in (1016, 2040, 40)]
    reqs = run_staggered(engine, prompts, StoppingParams(max_new_tokens=16, ignore_eos=True), every=1)
    compared = sum(assert_matches_reference(req.output_token_ids, req.output_logprobs, hf_greedy(model_dir, prompt, 16))
                   for prompt, req in zip(prompts, reqs))
    assert compared >= 40, compared
    assert_all_pages_returned(engine)


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_under_a_tiny_pool_keeps_tokens_exact(hf_checkpoint, arch):
    model_dir = hf_checkpoint(arch)
    # 12 pages of 16 tokens cannot hold six sequences growing to ~60 tokens each at once.
    engine = LLMEngine(EngineConfig(model=model_dir, num_pages=12, enable_prefix_caching=False))
    prompts = random_prompts(6, (20, 40), seed=3)
    reqs = run_staggered(engine, prompts, StoppingParams(max_new_tokens=24, ignore_eos=True), every=1)
    assert sum(r.num_preemptions for r in reqs) > 0, "the pool was meant to force preemption"
    for prompt, req in zip(prompts, reqs):
        assert_matches_reference(req.output_token_ids, req.output_logprobs, hf_greedy(model_dir, prompt, 24))
    assert engine.page_stats().free == engine.page_stats().total


def test_a_request_longer_than_the_whole_kv_pool_is_refused_and_one_that_fills_it_runs(model_dir):
    # 8 pages hold 128 tokens, under the model's 2,048: a longer sequence could never run, not even alone.
    engine = LLMEngine(EngineConfig(model=model_dir, num_pages=8, enable_prefix_caching=False))
    prompt = random_prompts(1, (100, 100), seed=9)[0]
    with pytest.raises(InvalidRequest) as err:
        engine.add_request(prompt, GREEDY, StoppingParams(max_new_tokens=29, ignore_eos=True))
    assert err.value.field == "max_new_tokens" and "over the context of 128" in str(err.value)
    [done] = engine.generate([prompt], GREEDY, StoppingParams(max_new_tokens=28, ignore_eos=True))
    assert done.finish_reason is FinishReason.LENGTH and len(done.token_ids) == 28
    assert engine.page_stats().free == engine.page_stats().total


def test_prefix_hit_reports_cached_tokens_and_same_tokens(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    engine = LLMEngine(EngineConfig(model=model_dir, num_pages=64))
    shared = random_prompts(1, (70, 70), seed=4)[0]
    a, b = shared + [7, 8, 9], shared + [10, 11]
    stop = StoppingParams(max_new_tokens=12, ignore_eos=True)
    [first] = engine.generate([a], GREEDY, stop)
    [second] = engine.generate([b], GREEDY, stop)
    assert first.num_cached_prompt_tokens == 0
    assert second.num_cached_prompt_tokens == 64  # four full pages of the shared 70 tokens
    assert_matches_reference(second.token_ids, second.logprobs, hf_greedy(model_dir, b, 12))
    [again] = engine.generate([a], GREEDY, stop)
    assert again.token_ids == first.token_ids and again.num_cached_prompt_tokens == 64
    assert_all_pages_returned(engine)


def test_prompts_given_together_with_one_shared_prefix_compute_it_once_and_match_transformers(hf_checkpoint):
    """Four prompts with a shared 300-token prefix in one call: the first computes its 18 full
    pages, the other three wait a step for them and take them from the cache, not computing them
    again in the same step; every output is transformers' greedy output."""
    model_dir = hf_checkpoint("llama")
    engine = LLMEngine(EngineConfig(model=model_dir, num_pages=64))
    shared = random_prompts(1, (300, 300), seed=5)[0]
    prompts = [shared + [7 + i] * (i + 1) for i in range(4)]
    done = engine.generate(prompts, GREEDY, StoppingParams(max_new_tokens=8, ignore_eos=True))
    assert [d.num_cached_prompt_tokens for d in done] == [0, 288, 288, 288]
    compared = sum(assert_matches_reference(d.token_ids, d.logprobs, hf_greedy(model_dir, p, 8))
                   for d, p in zip(done, prompts))
    assert compared >= 16, compared
    assert_all_pages_returned(engine)


def test_sequences_decoding_over_one_cached_prefix_match_transformers(hf_checkpoint):
    """A system prompt of 1,040 tokens cached, then five prompts that begin with it decoding side by
    side: the decode kernel reads the shared pages once for all five (a whole 1,024-token chunk, and
    the next page within each one's second chunk), with the benchmark model's heads (12 over 4 of
    64: the page-at-a-time float32 path); every greedy token and logprob is transformers'."""
    model_dir = hf_checkpoint("llama", hidden_size=768, num_attention_heads=12, num_key_value_heads=4,
                              intermediate_size=256, max_position_embeddings=2048)
    engine = LLMEngine(EngineConfig(model=model_dir, num_pages=160))
    system = random_prompts(1, (1040, 1040), seed=21)[0]
    engine.generate([system + [3]], GREEDY, StoppingParams(max_new_tokens=1, ignore_eos=True))
    prompts = [system + own for own in random_prompts(5, (1, 60), seed=22)]
    done = engine.generate(prompts, GREEDY, StoppingParams(max_new_tokens=12, ignore_eos=True))
    assert all(d.num_cached_prompt_tokens == 1040 for d in done)
    compared = sum(assert_matches_reference(d.token_ids, d.logprobs, hf_greedy(model_dir, p, 12))
                   for d, p in zip(done, prompts))
    assert compared >= 60, compared
    assert_all_pages_returned(engine)


def full_sequence_logprobs(model: CausalLM, token_ids: list[int]) -> torch.Tensor:
    """Log-softmax at every position of one sequence, in a fresh KV pool (one prefill)."""
    runner = ModelRunner(model, num_pages=-(-len(token_ids) // 16), page_size=16)
    slots = torch.arange(len(token_ids))
    batch = BatchInput(torch.tensor(token_ids), slots.clone(), slots, [SequenceSlice(0, len(token_ids), slots, None)], slots)
    return torch.log_softmax(model.forward(batch, runner.pool.k, runner.pool.v), dim=-1)


def test_bfloat16_stays_close_to_float32(hf_checkpoint):
    """Tolerance: over every position of 4 sequences, bfloat16's log-probabilities are within 0.1
    nats of float32's (mean under 0.02), and its top token agrees wherever float32's top two
    are more than 0.1 apart. Greedy runs of random tiny models flip on near-ties, so the check
    is made on the same tokens (teacher forcing), not on two free-running generations."""
    model_dir = hf_checkpoint("llama")
    f32, bf16 = CausalLM.load(model_dir), CausalLM.load(model_dir, "bfloat16")
    assert bf16.embed.dtype == torch.bfloat16
    for prompt in random_prompts(4, (10, 60), seed=5):
        [done] = LLMEngine(EngineConfig(num_pages=64), model=bf16).generate(
            [prompt], GREEDY, StoppingParams(max_new_tokens=8, ignore_eos=True))
        assert len(done.token_ids) == 8  # bfloat16 runs end to end
        tokens = prompt + done.token_ids
        a, b = full_sequence_logprobs(f32, tokens), full_sequence_logprobs(bf16, tokens)
        diff = (a - b).abs()
        assert diff.max() < 0.1 and diff.mean() < 0.02, (diff.max(), diff.mean())
        top2 = a.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.1
        assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


def test_seeded_sampling_is_the_same_alone_in_a_batch_and_after_preemption(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=100, seed=1234)
    stop = StoppingParams(max_new_tokens=20, ignore_eos=True)
    prompt = random_prompts(1, (30, 30), seed=6)[0]
    [alone] = LLMEngine(EngineConfig(model=model_dir, num_pages=64)).generate([prompt], sampling, stop)

    others = random_prompts(5, (5, 60), seed=7)
    batched = LLMEngine(EngineConfig(model=model_dir, num_pages=64))
    unseeded = SamplingParams(temperature=1.0)
    mix = [unseeded, unseeded, sampling, unseeded, unseeded, unseeded]
    reqs = run_staggered(batched, others[:2] + [prompt] + others[2:], stop, sampling=mix, every=1)
    assert reqs[2].output_token_ids == alone.token_ids

    tight = LLMEngine(EngineConfig(model=model_dir, num_pages=9, enable_prefix_caching=False))
    reqs = run_staggered(tight, [prompt] + others, stop, sampling=sampling, every=1)
    assert sum(r.num_preemptions for r in reqs) > 0
    assert reqs[0].output_token_ids == alone.token_ids
    # Different seeds do sample differently.
    [other_seed] = LLMEngine(EngineConfig(model=model_dir, num_pages=64)).generate(
        [prompt], SamplingParams(temperature=0.9, top_p=0.95, top_k=100, seed=99), stop)
    assert other_seed.token_ids != alone.token_ids


def test_stops_on_eos_stop_token_and_length(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    engine = LLMEngine(EngineConfig(model=model_dir, num_pages=64))
    prompt = random_prompts(1, (12, 12), seed=8)[0]
    [free_run] = engine.generate([prompt], GREEDY, StoppingParams(max_new_tokens=10, ignore_eos=True))
    stop_at = free_run.token_ids[4]
    [stopped] = engine.generate([prompt], GREEDY, StoppingParams(max_new_tokens=10, stop_token_ids=(stop_at,), ignore_eos=True))
    first = free_run.token_ids.index(stop_at)
    assert stopped.finish_reason is FinishReason.STOP and stopped.token_ids == free_run.token_ids[: first + 1]
    # The same weights with that token as the checkpoint's EOS: a request that does not ignore EOS ends there.
    eos_dir = hf_checkpoint("llama", eos_token_id=stop_at)
    [eos] = LLMEngine(EngineConfig(model=eos_dir, num_pages=64)).generate([prompt], GREEDY, StoppingParams(max_new_tokens=10))
    assert eos.finish_reason is FinishReason.EOS and eos.token_ids == free_run.token_ids[: first + 1]


@pytest.mark.parametrize(
    "prompt_len, sampling, stopping, field",
    [
        (0, GREEDY, StoppingParams(), "prompt"),
        (600, GREEDY, StoppingParams(max_new_tokens=1), "prompt"),
        (500, GREEDY, StoppingParams(max_new_tokens=20), "max_new_tokens"),
        (5, GREEDY, StoppingParams(max_new_tokens=0), "max_new_tokens"),
        (5, SamplingParams(temperature=-0.5), StoppingParams(), "temperature"),
        (5, SamplingParams(top_p=0.0), StoppingParams(), "top_p"),
        (5, SamplingParams(top_p=1.5), StoppingParams(), "top_p"),
        (5, SamplingParams(top_k=-1), StoppingParams(), "top_k"),
    ],
)
def test_bad_input_is_a_clear_error_and_the_batch_carries_on(hf_checkpoint, prompt_len, sampling, stopping, field):
    model_dir = hf_checkpoint("llama")  # context 512
    engine = LLMEngine(EngineConfig(model=model_dir, num_pages=64))
    good = random_prompts(2, (10, 30), seed=9)
    stop = StoppingParams(max_new_tokens=8, ignore_eos=True)
    reqs = [engine.add_request(good[0], GREEDY, stop)]
    engine.step()
    with pytest.raises(InvalidRequest) as err:
        engine.add_request([5] * prompt_len, sampling, stopping)
    assert err.value.field == field and field in str(err.value)
    reqs.append(engine.add_request(good[1], GREEDY, stop))
    while engine.has_unfinished():
        engine.step()
    for prompt, req in zip(good, reqs):
        assert req.finish_reason is FinishReason.LENGTH
        assert_matches_reference(req.output_token_ids, req.output_logprobs, hf_greedy(model_dir, prompt, 8))


def test_every_page_returns_after_finish_preemption_and_cancel(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    engine = LLMEngine(EngineConfig(model=model_dir, num_pages=10))
    prompts = random_prompts(6, (10, 50), seed=10)
    reqs = [engine.add_request(p, GREEDY, StoppingParams(max_new_tokens=30, ignore_eos=True)) for p in prompts]
    for _ in range(6):
        engine.step()
    engine.abort(reqs[0].request_id)  # running
    engine.abort(reqs[-1].request_id)  # likely still waiting
    with pytest.raises(InvalidRequest):
        engine.add_request([5] * 10, SamplingParams(top_k=-3), StoppingParams())
    while engine.has_unfinished():
        engine.step()
        engine.pool.check()
    assert engine.scheduler.num_preemptions > 0
    assert {r.finish_reason for r in reqs} == {FinishReason.CANCELLED, FinishReason.LENGTH}
    assert_all_pages_returned(engine)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_decode_steps_layers_in_one_call_give_the_per_operator_loops_logits(hf_checkpoint, arch, dtype):
    """Every step run twice on the same cache, its layers in one C++ call (`decode_layers`, where
    the step qualifies) and through forward's loop of operators: the same logits bit for bit, over
    staggered requests (steps of decodes alone between steps with prefill chunks), three of them
    over one cached prefix (the decode kernel's shared pages). Mistral's sliding window (24) is shorter
    than most sequences' contexts; Qwen2's projections have biases; bfloat16 multiplies in
    float32 on a CPU without AVX512-BF16."""
    model = CausalLM.load(hf_checkpoint(arch, **({"sliding_window": 24} if arch == "mistral" else {})), dtype)
    if model.decode_layers is None:
        pytest.skip("no few-rows kernel on this CPU (AVX-512 or AVX2)")
    one_call, calls = model.decode_layers, []
    model.decode_layers = lambda *args: calls.append(len(args[0])) or one_call(*args)
    forward, compared = model.forward, []

    def both_ways(batch, k_cache, v_cache):
        logits = forward(batch, k_cache, v_cache)
        model.decode_layers, fast = None, model.decode_layers
        try:
            loop = forward(batch, k_cache, v_cache)
        finally:
            model.decode_layers = fast
        assert torch.equal(logits, loop)
        compared.append(logits.shape[0])
        return loop

    model.forward = both_ways
    engine = LLMEngine(EngineConfig(num_pages=128), model=model)
    shared = random_prompts(1, (40, 40), seed=31)[0]
    prompts = random_prompts(3, (5, 70), seed=32) + [shared + own for own in random_prompts(3, (1, 20), seed=33)]
    run_staggered(engine, prompts, StoppingParams(max_new_tokens=16, ignore_eos=True), every=2)
    # decode steps took the one call, up to the few-rows kernel's row limit (one row for bfloat16 on AMX)
    limit = min(p.small_limit for layer in model.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert len(calls) >= 2 and max(calls) == min(limit, len(prompts)), (calls, limit)
    assert len(compared) > len(calls)  # and steps with prompts went through the loop
    assert_all_pages_returned(engine)


def test_steps_whose_mlp_runs_in_blocks_of_rows_match_transformers(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    engine = LLMEngine(EngineConfig(model=model_dir, num_pages=64))
    # A step of more rows than fit the CPU's cache runs the MLP in blocks; 7 rows here, so the prompt
    # step (about 150 rows) runs in blocks of 7 and a shorter last one, and the decode steps (4 rows) in one.
    engine.model.mlp_rows = 7
    prompts = random_prompts(4, (20, 60), seed=5)
    done = engine.generate(prompts, GREEDY, StoppingParams(max_new_tokens=12, ignore_eos=True))
    compared = sum(assert_matches_reference(r.token_ids, r.logprobs, hf_greedy(model_dir, p, 12))
                   for p, r in zip(prompts, done))
    assert compared >= 40, f"compared only {compared} tokens"


@pytest.mark.parametrize("mlp_rows", [1 << 20, 40], ids=["one-block", "mlp-blocks"])
def test_bfloat16_steps_padded_to_onednns_row_counts_give_the_unpadded_steps_tokens(hf_checkpoint, mlp_rows):
    model_dir = hf_checkpoint("llama")
    prompts = random_prompts(5, (35, 90), seed=11)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch: no products padded")
    runs, steps = [], []
    for pad in (False, True):
        model = CausalLM.load(model_dir, "bfloat16")
        if model.linear_dtype != torch.bfloat16:
            pytest.skip("this CPU multiplies bfloat16 in float32 (no bfloat16 kernel): no products padded")
        for layer in model.layers:  # every product through oneDNN
            for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
                linear.add_onednn_copy()
                linear.small_limit = 0
        model.mlp_rows = mlp_rows

        def step_rows(t, model_rows=model.step_rows, pad=pad):
            # without padding, as before: the step's own rows, the MLP in even blocks and a shorter last one
            rows, block = model_rows(t) if pad else (t, -(-t // -(-t // mlp_rows)))
            steps.append((pad, t, rows, block))
            return rows, block

        model.step_rows = step_rows
        engine = LLMEngine(EngineConfig(num_pages=96), model=model)
        reqs = run_staggered(engine, prompts, StoppingParams(max_new_tokens=10, ignore_eos=True), every=2)
        runs.append([(r.output_token_ids, r.output_logprobs) for r in reqs])
        assert_all_pages_returned(engine)
    assert runs[1] == runs[0]  # the same tokens, the same log-probabilities to the bit
    padded = [(t, rows, block) for pad, t, rows, block in steps if pad]
    # every step took oneDNN's counts; those of prompts beside decodes more rows than their tokens
    assert all(rows >= t and rows - t <= rows // 16 for t, rows, _ in padded), padded
    assert all(rows % block == 0 and onednn_rows(block) == block for _, rows, block in padded), padded
    assert sum(rows > t for t, rows, _ in padded) >= 3, padded
    if mlp_rows == 40:
        assert any(rows > block for _, rows, block in padded), padded  # the MLP ran in blocks


def test_the_mlp_block_keeps_its_output_within_half_the_last_level_cache(monkeypatch):
    from kvmesh.services.worker import model as model_module

    monkeypatch.setattr(model_module, "last_level_cache_bytes", lambda: 32 << 20)  # a Zen 4's two cores
    cpu = torch.device("cpu")
    # the benchmark model (MLP 2,048 wide): 16 KiB of gate|up output a row in float32, 8 KiB in bfloat16
    assert model_module.mlp_block_rows(2048, 4, cpu) == 1024
    assert model_module.mlp_block_rows(2048, 2, cpu) == 2048
    assert model_module.mlp_block_rows(1 << 20, 4, cpu) == model_module.MIN_MLP_BLOCK_ROWS
    assert model_module.mlp_block_rows(2048, 4, torch.device("meta")) > 1 << 40  # no blocks off the CPU
    monkeypatch.setattr(model_module, "last_level_cache_bytes", lambda: 0)  # none reported: 32 MiB assumed
    assert model_module.mlp_block_rows(2048, 4, cpu) == 1024


def test_the_last_level_cache_is_read_from_linux():
    from kvmesh.services.worker.model import last_level_cache_bytes

    size = last_level_cache_bytes()
    # what /sys reports: the largest of the first CPU's caches (0 where it reports none)
    assert size == 0 or size >= 256 << 10, size


@pytest.mark.parametrize("amx,bf16_dot", [(False, False), (False, True), (True, True)],
                         ids=["no-bf16-dot", "avx512-bf16", "amx"])
def test_the_engine_takes_the_models_step_size_unless_given_one(hf_checkpoint, amx, bf16_dot, monkeypatch):
    """1,024 tokens a step, but 2,048 offline for bfloat16 on a CPU that multiplies it natively
    (AVX512-BF16 or AMX), where a served worker reports 2,048 only with AMX (oneDNN's tile kernels
    are slow at a 1,024-token step's rows there); a budget given is kept."""
    from kvmesh.kernels import linear, native
    from kvmesh.services.worker.device import default_step_tokens

    monkeypatch.setattr(native, "amx_tiles", lambda: amx)
    monkeypatch.setattr(linear, "native_half_products", lambda dtype: bf16_dot)
    model_dir = hf_checkpoint("llama")
    steps = {dtype: LLMEngine(EngineConfig(model=model_dir, dtype=dtype, num_pages=16)).scheduler.config.max_batched_tokens
             for dtype in ("float32", "bfloat16")}
    assert steps == {"float32": 1024, "bfloat16": 2048 if bf16_dot else 1024}
    served = {dtype: default_step_tokens(torch.device("cpu"), dtype) for dtype in (torch.float32, torch.bfloat16)}
    assert served == {torch.float32: 1024, torch.bfloat16: 2048 if amx else 1024}
    given = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", num_pages=16,
                                   scheduler=SchedulerConfig(max_batched_tokens=40)))
    assert given.scheduler.config.max_batched_tokens == 40
