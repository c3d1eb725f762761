"""kvmesh's Triton paged-attention kernels against the reference: on a GPU with `-m cuda`, and on
the CPU through Triton's interpreter (conftest sets TRITON_INTERPRET=1) at small shapes."""

import pytest
import torch

pytest.importorskip("triton", reason="Triton has no wheel for this platform")
from kvmesh.kernels import triton_attention as ta  # noqa: E402
from kvmesh.kernels.attention import SequenceSlice, causal_mask, paged_attention_reference, write_kv  # noqa: E402

PAGE = 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.cuda  # all of them run on the GPU where there is one (bench/gpu_check.sh: -m cuda)


def paged_case(layout, heads=4, kv_heads=2, dim=32, num_pages=48, seed=0, window=None, dtype=torch.float32):
    """Random K/V for each (context, queries) sequence in randomly chosen pages; the flattened
    queries, the caches, the slices the reference reads and the page tables the kernels read."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(num_pages * PAGE, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_pages, generator=g).tolist()
    seqs, tables, queries, row = [], [], [], 0
    for ctx, nq in layout:
        pages = torch.tensor([free.pop() for _ in range(-(-ctx // PAGE))])
        slots = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()[:ctx]
        write_kv(k_cache, v_cache, slots, torch.randn(ctx, kv_heads, dim, generator=g), torch.randn(ctx, kv_heads, dim, generator=g))
        queries.append(torch.randn(nq, heads, dim, generator=g))
        seqs.append(SequenceSlice(row, row + nq, slots, causal_mask(nq, ctx, window)))
        tables.append(pages)
        row += nq
    table = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True).to(torch.int32)
    q = torch.cat(queries)
    return (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)), seqs, table


def to(device, *tensors):
    return [t.to(device) for t in tensors]


def run_decode(layout, window=None, splits=None, dtype=torch.float32, **shape):
    (q, kc, vc), seqs, table = paged_case(layout, window=window, dtype=dtype, **shape)
    rows = torch.tensor([s.query_start for s in seqs], dtype=torch.int32)
    lens = torch.tensor([s.context_len for s in seqs], dtype=torch.int32)
    qd, kd, vd, rd, td, ld = to(DEVICE, q, kc, vc, rows, table, lens)
    out = torch.zeros_like(qd)
    ta.decode_attention(qd, kd, vd, out, rd, td, ld, scale=0.3, page_size=PAGE, max_context=int(lens.max()),
                        window=window, splits=splits)
    ref = paged_attention_reference(q.float(), kc.float(), vc.float(), seqs, 0.3, sliding_window=window)
    return out.cpu().float(), ref


def run_prefill(layout, window=None, dtype=torch.float32, block_m=16, **shape):
    (q, kc, vc), seqs, table = paged_case(layout, window=window, dtype=dtype, **shape)
    starts = torch.tensor([s.query_start for s in seqs], dtype=torch.int32)
    q_lens = torch.tensor([s.num_queries for s in seqs], dtype=torch.int32)
    lens = torch.tensor([s.context_len for s in seqs], dtype=torch.int32)
    qd, kd, vd, sd, nd, td, ld = to(DEVICE, q, kc, vc, starts, q_lens, table, lens)
    out = torch.zeros_like(qd)
    ta.prefill_attention(qd, kd, vd, out, sd, nd, td, ld, scale=0.3, page_size=PAGE, max_queries=int(q_lens.max()),
                         window=window, block_m=block_m)
    ref = paged_attention_reference(q.float(), kc.float(), vc.float(), seqs, 0.3, sliding_window=window)
    return out.cpu().float(), ref


@pytest.mark.parametrize("layout, splits", [
    ([(1, 1)], None),  # the first token
    ([(50, 1), (17, 1), (64, 1)], None),  # page-aligned and not
    ([(300, 1), (7, 1)], 3),  # split-KV: a long context cut in three, a short one whose later splits are empty
])
def test_decode_kernel_equals_reference(layout, splits):
    out, ref = run_decode(layout, splits=splits)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_decode_kernel_reads_each_kv_head_once_for_its_whole_group():
    """8 query heads over 1 KV head (GQA 8:1), head_dim 24 (not a power of two)."""
    out, ref = run_decode([(40, 1), (33, 1)], heads=8, kv_heads=1, dim=24, splits=2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_decode_kernel_sliding_window():
    out, ref = run_decode([(90, 1), (20, 1)], window=24, splits=2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("layout", [
    [(37, 37)],  # a fresh prompt
    [(70, 22), (48, 48), (5, 5)],  # a chunk after a cached prefix, beside fresh prompts
    [(40, 3)],  # a short chunk late in the sequence
])
def test_prefill_kernel_equals_reference(layout):
    out, ref = run_prefill(layout)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_prefill_kernel_sliding_window_and_gqa():
    out, ref = run_prefill([(80, 40), (30, 30)], window=20, heads=6, kv_heads=2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_kernels_in_half_precision():
    """float16 K/V and queries; scores and softmax stay float32 inside."""
    out, ref = run_decode([(45, 1), (19, 1)], dtype=torch.float16)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    out, ref = run_prefill([(45, 13)], dtype=torch.float16)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


def test_splits_fill_the_device_but_never_cut_below_the_minimum():
    assert ta.num_splits(max_context=100, num_seqs=1, kv_heads=8) == 1
    assert ta.num_splits(max_context=32_768, num_seqs=1, kv_heads=8) == ta.MAX_SPLITS
    assert ta.num_splits(max_context=32_768, num_seqs=256, kv_heads=8) == 1  # the batch fills it already


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernels_at_realistic_shapes_on_the_gpu(dtype):
    """Llama-3-8B's attention shape (32 heads over 8 KV heads, head_dim 128), long contexts."""
    shape = dict(heads=32, kv_heads=8, dim=128, num_pages=2048)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    out, ref = run_decode([(4000, 1), (1, 1), (2500, 1), (17, 1)] * 4, dtype=dtype, **shape)
    torch.testing.assert_close(out, ref, **tol)
    out, ref = run_prefill([(3000, 512), (700, 700), (64, 1)], dtype=dtype, block_m=64, **shape)
    torch.testing.assert_close(out, ref, **tol)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_the_model_through_the_triton_kernels_matches_transformers(hf_checkpoint, arch):
    """The whole runtime on the Triton path (the worker's path on CUDA): staggered requests whose
    long prompts prefill in chunks beside decodes, then a prefix-cache hit; Mistral with a sliding
    window shorter than the sequences. Greedy tokens and logprobs equal transformers'."""
    from kvmesh.engine import EngineConfig, LLMEngine
    from kvmesh.params import SamplingParams, StoppingParams
    from kvmesh.services.scheduler.core import SchedulerConfig
    from kvmesh.services.worker.model import CausalLM
    from reference import assert_matches_reference, hf_greedy
    from test_engine import random_prompts, run_staggered

    overrides = {"sliding_window": 24} if arch == "mistral" else {}
    model_dir = hf_checkpoint(arch, **overrides)
    model = CausalLM.load(model_dir, device=DEVICE)
    model.attention_backend = "triton"
    engine = LLMEngine(EngineConfig(model=model_dir, num_pages=96, scheduler=SchedulerConfig(max_batched_tokens=40)),
                       model=model)
    greedy, stop = SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=12, ignore_eos=True)
    prompts = random_prompts(5, (5, 70), seed=7)
    reqs = run_staggered(engine, prompts, stop, greedy)
    longest = max(prompts, key=len)
    prompts.append(longest[:48] + [5, 6, 7])  # three full pages in the cache from the longest
    [hit] = engine.generate([prompts[-1]], greedy, stop)
    assert hit.num_cached_prompt_tokens == 48
    outputs = [(r.output_token_ids, r.output_logprobs) for r in reqs] + [(hit.token_ids, hit.logprobs)]
    compared = sum(assert_matches_reference(tokens, logprobs, hf_greedy(model_dir, p, 12))
                   for p, (tokens, logprobs) in zip(prompts, outputs))
    assert compared >= 5 * 12, compared
