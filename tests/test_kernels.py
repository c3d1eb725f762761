"""Paged attention against dense causal attention, and the fast path against the reference."""

import math
import os
import shutil
import time

import pytest
import torch
import torch.nn.functional as F

from kvmesh.kernels import native
from kvmesh.kernels.attention import AttentionPlan, SequenceSlice, causal_mask, paged_attention_reference, write_kv

PAGE = 16


def build_case(lengths_and_queries, heads=8, kv_heads=2, dim=32, num_pages=64, seed=0, window=None):
    """Random K/V for each sequence, written into randomly chosen pages; returns what both sides need."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(num_pages * PAGE, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_pages, generator=g).tolist()
    seqs, dense, q_rows, row = [], [], [], 0
    for ctx, nq in lengths_and_queries:
        pages = torch.tensor([free.pop() for _ in range(-(-ctx // PAGE))])
        slots = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()[:ctx]
        k = torch.randn(ctx, kv_heads, dim, generator=g)
        v = torch.randn(ctx, kv_heads, dim, generator=g)
        write_kv(k_cache, v_cache, slots, k, v)
        q = torch.randn(nq, heads, dim, generator=g)
        seqs.append(SequenceSlice(row, row + nq, slots, causal_mask(nq, ctx, window)))
        dense.append((q, k, v))
        q_rows.append(q)
        row += nq
    return torch.cat(q_rows), k_cache, v_cache, seqs, dense


def dense_attention(q, k, v, scale, window=None):
    """Plain causal attention over one sequence's contiguous K/V (the last len(q) positions query)."""
    heads = q.shape[1]
    k = k.repeat_interleave(heads // k.shape[1], dim=1).transpose(0, 1)
    v = v.repeat_interleave(heads // v.shape[1], dim=1).transpose(0, 1)
    ctx, nq = k.shape[1], q.shape[0]
    pos_q = torch.arange(ctx - nq, ctx)[:, None]
    pos_k = torch.arange(ctx)[None, :]
    mask = pos_k <= pos_q
    if window:
        mask &= pos_k > pos_q - window
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale).transpose(0, 1)


CASES = [
    [(1, 1)],  # first token
    [(37, 37)],  # prefill from position 0
    [(50, 1), (17, 1), (64, 1)],  # decodes, page-aligned and not
    [(70, 22), (33, 1), (48, 48)],  # a prefill chunk after a cached prefix, beside others
]


@pytest.mark.parametrize("layout", CASES)
def test_reference_equals_dense_causal_attention(layout):
    q, kc, vc, seqs, dense = build_case(layout)
    out = paged_attention_reference(q, kc, vc, seqs, scale=32**-0.5)
    for s, (dq, dk, dv) in zip(seqs, dense):
        torch.testing.assert_close(out[s.query_start : s.query_end], dense_attention(dq, dk, dv, 32**-0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", CASES)
def test_fast_path_equals_reference(layout):
    q, kc, vc, seqs, _ = build_case(layout, seed=1)
    ref = paged_attention_reference(q, kc, vc, seqs, scale=0.2)
    torch.testing.assert_close(AttentionPlan(seqs)(q, kc, vc, 0.2), ref, atol=1e-5, rtol=1e-5)


def test_sliding_window_limits_what_a_query_sees():
    layout = [(60, 1), (60, 12)]
    q, kc, vc, seqs, dense = build_case(layout, seed=2, window=20)
    fast = AttentionPlan(seqs)(q, kc, vc, 0.2)
    ref = paged_attention_reference(q, kc, vc, seqs, scale=0.2, sliding_window=20)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    for s, (dq, dk, dv) in zip(seqs, dense):
        torch.testing.assert_close(ref[s.query_start : s.query_end], dense_attention(dq, dk, dv, 0.2, window=20), atol=1e-5, rtol=1e-5)


def test_contiguous_runs_are_read_in_place_with_the_same_result():
    q, kc, vc, seqs, _ = build_case([(40, 1), (33, 9)], seed=3)
    ref = paged_attention_reference(q, kc, vc, seqs, scale=0.2)
    # Move each sequence's KV to one contiguous run of slots and read it in place.
    k2, v2 = torch.zeros_like(kc), torch.zeros_like(vc)
    moved, start = [], 0
    for s in seqs:
        run = torch.arange(start, start + s.context_len)
        write_kv(k2, v2, run, kc[s.slots], vc[s.slots])
        moved.append(SequenceSlice(s.query_start, s.query_end, run, s.mask, first_slot=start))
        start += -(-s.context_len // PAGE) * PAGE
    torch.testing.assert_close(AttentionPlan(moved)(q, k2, v2, 0.2), ref, atol=1e-5, rtol=1e-5)


def test_the_decode_kernel_builds_on_this_machine():
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler here: decodes take torch's attention per sequence")
    assert native.decode_attention() is not None
    # Where the loader looks is where torch built it, so a later process loads it without a build.
    assert native.library_path().is_file()


DECODES = [(1, 1), (16, 1), (17, 1), (300, 1), (70, 22), (5, 1)]  # with a prefill chunk among them


# Of the head sizes the kernel is compiled for (16, 24, 32, 64, 80, 96, 128, 256), multiples of 16
# take the AVX-512 path where the CPU has one, all of them the AVX2 path where it has that instead;
# 20 takes the portable path everywhere. The AVX2 path scores a row's query heads eight, four,
# then one at a time: 14 heads are 8 + 4 + 1 + 1, 32 are four batches of eight. The AVX-512 float32
# path goes a page at a time for models of eight query heads or more (16 at a time, the last four
# or fewer by sum4), by per-head blocks for fewer (4 heads).
@pytest.mark.parametrize("dim", [16, 20, 24, 32, 64, 80, 128])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (12, 4), (4, 4), (14, 2), (32, 8)])
def test_decode_kernel_equals_reference(dim, heads, kv_heads):
    q, kc, vc, seqs, _ = build_case(DECODES, heads=heads, kv_heads=kv_heads, dim=dim, seed=dim + heads)
    plan = AttentionPlan(seqs)
    assert len(plan.decodes) == (5 if native.decode_attention() else 0)
    ref = paged_attention_reference(q, kc, vc, seqs, scale=dim**-0.5)
    torch.testing.assert_close(plan(q, kc, vc, dim**-0.5), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(12, 4), (14, 2), (4, 4), (20, 4)])
def test_decode_kernel_gives_the_same_bits_however_its_work_is_split(heads, kv_heads, dtype):
    # One thread takes each sequence with all its heads; four threads, with five sequences, take
    # (sequence, KV head) pairs: every query head's output must come out bit for bit the same
    # (with AVX512-BF16, bfloat16 scores 16 heads of a row at a time: 20 heads are 16 + 4 whole,
    # 5 a pair).
    q, kc, vc, seqs, _ = build_case(DECODES, heads=heads, kv_heads=kv_heads, dim=64, seed=heads)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = AttentionPlan(seqs)(q, kc, vc, 0.125)
        torch.set_num_threads(4)
        split = AttentionPlan(seqs)(q, kc, vc, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole, split)


# Contexts past 1,024 tokens are cut into chunks of 1,024 whose softmaxes are merged: one chunk
# exactly, one token past it, two chunks exactly, and three beside a short sequence.
LONG_DECODES = [(2500, 1), (1024, 1), (1025, 1), (5, 1), (2048, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim,heads,kv_heads", [(64, 12, 4), (16, 4, 2), (128, 8, 8), (20, 4, 2)])
def test_decode_kernel_over_contexts_cut_into_chunks_equals_the_reference(dim, heads, kv_heads, dtype):
    q, kc, vc, seqs, _ = build_case(LONG_DECODES, heads=heads, kv_heads=kv_heads, dim=dim, num_pages=420, seed=dim)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    plan = AttentionPlan(seqs)
    assert len(plan.decodes) == (5 if native.decode_attention() else 0)
    ref = paged_attention_reference(q.float(), kc.float(), vc.float(), seqs, scale=dim**-0.5)
    out = plan(q, kc, vc, dim**-0.5)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:  # as in half precision over short contexts (below)
        assert (out.float() - ref.to(dtype).float()).abs().max() <= (ref.abs().max() * 2 ** -7).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(12, 4, 64), (4, 2, 16)])
def test_a_long_context_gives_the_same_bits_whatever_the_threads_and_the_batch(heads, kv_heads, dim, dtype):
    # Nine chunks: one thread takes them whole, two and four threads share them as whole chunks,
    # eight take (chunk, KV head) pairs; the 2,500-token sequence alone (three chunks) goes by pairs on
    # two threads. A chunk's partial softmax and the merge must come out the same every way.
    q, kc, vc, seqs, _ = build_case(LONG_DECODES, heads=heads, kv_heads=kv_heads, dim=dim, num_pages=420, seed=3)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 4, 8):
            torch.set_num_threads(n)
            outs.append(AttentionPlan(seqs)(q, kc, vc, 0.125))
        torch.set_num_threads(2)
        alone = AttentionPlan([SequenceSlice(0, 1, seqs[0].slots, None)])(q[:1], kc, vc, 0.125)
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        assert torch.equal(outs[0], out)
    assert torch.equal(alone, outs[0][:1])


def shared_prefix_case(prefix: int, own: list[int], heads=12, kv_heads=4, dim=64, seed=0, dtype=torch.float32):
    """Decoding sequences whose page tables begin with the same `prefix` tokens' pages (as after a
    prefix-cache hit), each with `own` more tokens in pages of its own, pages scattered."""
    g = torch.Generator().manual_seed(seed)
    own_pages = [-(-n // PAGE) for n in own]
    pages = torch.randperm(prefix // PAGE + sum(own_pages), generator=g)
    k_cache = torch.randn(pages.numel() * PAGE, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(pages.numel() * PAGE, kv_heads, dim, generator=g).to(dtype)
    shared, at, seqs = pages[: prefix // PAGE], prefix // PAGE, []
    for i, (n, count) in enumerate(zip(own, own_pages)):
        table = torch.cat([shared, pages[at : at + count]])
        at += count
        seqs.append(SequenceSlice(i, i + 1, (table[:, None] * PAGE + torch.arange(PAGE)).flatten()[: prefix + n], None))
    return torch.randn(len(own), heads, dim, generator=g).to(dtype), k_cache, v_cache, seqs


# (shared prefix, each sequence's own tokens): contexts within one chunk whose members go on past the
# shared pages; a 1,024-token prefix that is a whole chunk of every member; a 2,048-token prefix (two
# shared chunks) with one member cut into three.
SHARED = [(512, [3, 100, 1]), (1024, [40, 1, 77, 16]), (2048, [5, 1030, 64])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(12, 4, 64), (32, 8, 128), (16, 16, 32), (4, 2, 16)])
@pytest.mark.parametrize("prefix,own", SHARED)
def test_sequences_sharing_a_prefix_are_computed_together_with_the_bits_each_has_alone(prefix, own, heads, kv_heads,
                                                                                       dim, dtype):
    # On the page-at-a-time AVX-512 paths (float32 with eight query heads or more, bfloat16 with
    # AVX512-BF16) chunks that begin with the same pages are one unit: the shared pages are read once
    # for every member's heads, then each member goes on alone. Whatever shares its step, and on any
    # number of threads, a sequence's output must have the bits it has alone, and match the reference.
    q, kc, vc, seqs = shared_prefix_case(prefix, own, heads, kv_heads, dim, dtype=dtype)
    plan = AttentionPlan(seqs)
    if native.decode_attention() is None:
        pytest.skip("the decode kernel is not built here")
    units = native.decode_shared_units()(plan.indptr, plan.slot_ids)
    assert units[0, 1].item() == len(own) and units[0, 2].item() == min(prefix, 1024)
    threads = torch.get_num_threads()
    try:
        together = []
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            together.append(AttentionPlan(seqs)(q, kc, vc, dim**-0.5))
        alone = torch.cat([AttentionPlan([SequenceSlice(0, 1, s.slots, None)])(q[i : i + 1], kc, vc, dim**-0.5)
                           for i, s in enumerate(seqs)])
    finally:
        torch.set_num_threads(threads)
    for out in together:
        assert torch.equal(out, alone)
    ref = paged_attention_reference(q.float(), kc.float(), vc.float(), seqs, scale=dim**-0.5)
    if dtype == torch.float32:
        torch.testing.assert_close(together[0], ref, atol=1e-5, rtol=1e-5)
    else:
        assert (together[0].float() - ref.to(dtype).float()).abs().max() <= (ref.abs().max() * 2 ** -7).item()


def test_the_decode_kernel_shares_whole_pages_that_every_member_of_a_unit_agrees_on():
    if native.decode_shared_units() is None:
        pytest.skip("the decode kernel is not built here")
    # Sequence 0 leads; 1 agrees on 300 slots (18 whole pages: 288), 2 on all 1,024 of chunk 0 and
    # more, 3 on 40 slots (under 64: alone), 4 begins elsewhere. Sequences 0 and 2's second chunks
    # begin with the same slot too and agree on 48 slots of it: fewer than 64, so apart.
    base = torch.arange(0, 4096)
    tables = [base[:1100], torch.cat([base[:300], base[3000:3100]]), base[:1072],
              torch.cat([base[:40], base[2000:2100]]), base[1200:1300]]
    indptr = torch.tensor([0] + [t.numel() for t in tables]).cumsum(0)
    units = native.decode_shared_units()(indptr, torch.cat(tables).contiguous()).tolist()
    # chunks in order: 0a, 0b, 1, 2a, 2b, 3, 4
    assert units == [[0, 3, 288], [1, 1, 0], [0, 3, 288], [0, 3, 288], [2, 1, 0], [3, 1, 0], [4, 1, 0]]


def test_the_decode_kernel_halves_its_largest_shared_unit_until_its_threads_have_work():
    if native.decode_shared_units() is None:
        pytest.skip("the decode kernel is not built here")
    # Six sequences over one 320-token prefix: one unit; halves where a unit may have four members;
    # with four units wanted (many threads, few KV heads), halves of halves, each pair still sharing
    # the prefix and single ones alone.
    tables = [torch.cat([torch.arange(320), torch.arange(1000 + 100 * i, 1010 + 100 * i)]) for i in range(6)]
    indptr = torch.tensor([0] + [t.numel() for t in tables]).cumsum(0)
    slots = torch.cat(tables).contiguous()
    units = native.decode_shared_units()
    assert units(torch.zeros(1, dtype=torch.long), torch.zeros(0, dtype=torch.long)).shape == (0, 3)  # no sequences
    assert units(indptr, slots).tolist() == [[0, 6, 320]] * 6
    assert units(indptr, slots, 4).tolist() == [[0, 3, 320]] * 3 + [[1, 3, 320]] * 3  # at most four a unit
    assert units(indptr, slots, 8, 4).tolist() == [
        [0, 1, 0], [1, 2, 320], [1, 2, 320], [2, 1, 0], [3, 2, 320], [3, 2, 320]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim,heads,kv_heads", [(32, 4, 2), (64, 8, 2), (128, 12, 4), (40, 4, 4), (16, 4, 2), (20, 4, 2),
                                               (64, 20, 4), (256, 4, 2)])
def test_decode_kernel_in_half_precision_equals_the_reference_on_the_same_inputs(dtype, dim, heads, kv_heads):
    q, kc, vc, seqs, _ = build_case(DECODES, heads=heads, kv_heads=kv_heads, dim=dim, seed=7)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    ref = paged_attention_reference(q.float(), kc.float(), vc.float(), seqs, scale=dim**-0.5)
    out = AttentionPlan(seqs)(q, kc, vc, dim**-0.5)
    assert out.dtype == dtype
    # The kernel computes in float32 from the half-precision values (with AVX512-BF16, P.V rounds the
    # weights to bfloat16 first, as transformers does): only roundings of that size differ.
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    assert (out.float() - ref.to(dtype).float()).abs().max() <= (ref.abs().max() * 2 ** -7).item()


@pytest.mark.parametrize("dim", [16, 64])
def test_decode_kernel_is_exact_when_scores_span_hundreds_of_nats(dim):
    """Large queries: most keys' weights underflow to (nearly) zero beside the largest, where the
    vector exp is clamped; the output is still softmax's. Held to a float64 reference: scores of
    some hundreds carry float32 rounding of about 1e-5 absolute, which softmax turns into relative
    error of that size in the weights, so float32's own reference is about 4e-5 off here (a wrong
    clamp or mask is off by the size of V's values, about 1)."""
    q, kc, vc, seqs, _ = build_case(DECODES, heads=8, kv_heads=2, dim=dim, seed=11)
    q = q * 60
    exact = paged_attention_reference(q.double(), kc.double(), vc.double(), seqs, scale=dim**-0.5)
    out = AttentionPlan(seqs)(q, kc, vc, dim**-0.5)
    torch.testing.assert_close(out.double(), exact, atol=2e-4, rtol=2e-4)


def test_decode_kernel_keeps_to_the_sliding_window():
    q, kc, vc, seqs, _ = build_case([(60, 1), (25, 1), (60, 12)], dim=64, seed=8, window=20)
    ref = paged_attention_reference(q, kc, vc, seqs, scale=0.2, sliding_window=20)
    torch.testing.assert_close(AttentionPlan(seqs)(q, kc, vc, 0.2), ref, atol=1e-5, rtol=1e-5)


def test_without_the_kernels_every_sequence_takes_the_portable_path(monkeypatch):
    monkeypatch.setattr(native, "decode_attention", lambda: None)
    monkeypatch.setattr(native, "prefill_attention", lambda: None)
    q, kc, vc, seqs, _ = build_case(DECODES, dim=64, seed=9)
    plan = AttentionPlan(seqs)
    assert plan.decodes == [] and plan.prefills == [] and plan.others == seqs
    ref = paged_attention_reference(q, kc, vc, seqs, scale=0.125)
    torch.testing.assert_close(plan(q, kc, vc, 0.125), ref, atol=1e-5, rtol=1e-5)


# Prefill chunks: from position 0, after a cached prefix (the chunk's first query sees earlier
# pages), shorter and longer than a tile of query tokens (16, or 32 without GQA) and a block of
# keys (32), beside decodes.
PREFILLS = [(37, 37), (70, 22), (33, 1), (300, 300), (600, 77), (2, 2), (17, 16), (5, 1)]


@pytest.mark.parametrize("dim", [16, 32, 64, 80, 128])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (12, 4), (4, 4), (14, 2)])
def test_prefill_kernel_equals_reference(dim, heads, kv_heads):
    q, kc, vc, seqs, _ = build_case(PREFILLS, heads=heads, kv_heads=kv_heads, dim=dim, num_pages=96, seed=dim + heads)
    plan = AttentionPlan(seqs)
    assert len(plan.prefills) == (6 if native.prefill_attention() else 0)
    ref = paged_attention_reference(q, kc, vc, seqs, scale=dim**-0.5)
    torch.testing.assert_close(plan(q, kc, vc, dim**-0.5), ref, atol=1e-5, rtol=1e-5)


# Sequences with 8 MiB of K and V or more are computed in tiles four times as tall (64 query tokens
# with GQA, 128 without): 1,024 tokens of 8 KV heads of 128 in float32, 2,048 with 4 or in bfloat16.
@pytest.mark.parametrize("dtype,heads,kv_heads,layout", [
    (torch.float32, 8, 8, [(1100, 90), (1030, 200), (40, 40)]),
    (torch.float32, 16, 4, [(2100, 90), (300, 300)]),
    (torch.bfloat16, 8, 8, [(2100, 70), (40, 40)]),
])
def test_prefill_kernel_in_tall_tiles_equals_the_reference(dtype, heads, kv_heads, layout):
    pages = sum(-(-ctx // PAGE) for ctx, _ in layout)
    q, kc, vc, seqs, _ = build_case(layout, heads=heads, kv_heads=kv_heads, dim=128, num_pages=pages, seed=heads)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    plan = AttentionPlan(seqs)
    assert len(plan.prefills) == (len(layout) if native.prefill_attention() else 0)
    ref = paged_attention_reference(q.double(), kc.double(), vc.double(), seqs, scale=128**-0.5)
    out = plan(q, kc, vc, 128**-0.5).double()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:  # as in half precision over short contexts (below)
        assert (out - ref).abs().max() <= (ref.abs().max() * 2 ** -6).item()


@pytest.mark.parametrize("tiles", [False, True], ids=["vectors", "tiles"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim,heads,kv_heads", [(64, 12, 4), (128, 8, 2), (32, 4, 4)])
def test_prefill_kernel_in_half_precision_equals_the_reference_on_the_same_inputs(dtype, dim, heads, kv_heads, tiles,
                                                                                  monkeypatch):
    """The kernel's vector path, and (bfloat16, where the CPU has AMX) its tile path."""
    calls = []
    op = native.prefill_attention()
    if op is not None:
        monkeypatch.setattr(native, "prefill_attention", lambda: lambda *a: calls.append(1) or op(*a, tiles=tiles))
    q, kc, vc, seqs, _ = build_case(PREFILLS, heads=heads, kv_heads=kv_heads, dim=dim, num_pages=96, seed=5)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    ref = paged_attention_reference(q.double(), kc.double(), vc.double(), seqs, scale=dim**-0.5)
    out = AttentionPlan(seqs)(q, kc, vc, dim**-0.5)
    assert calls == ([] if op is None else [1])
    assert out.dtype == dtype
    # float32 arithmetic on the half-precision values (with AVX512-BF16 or AMX, P.V rounds the
    # weights to bfloat16 first, as transformers does), the result rounded once more.
    assert (out.double() - ref).abs().max() <= (ref.abs().max() * 2 ** -6).item()


def prefill_on_tiles(q, kc, vc, seqs, scale, window=0, tiles=True):
    """One call of the prefill kernel over every slice, as AttentionPlan makes it."""
    plan = AttentionPlan(seqs, sliding_window=window)
    out = torch.zeros_like(q)
    native.prefill_attention()(q, kc, vc, plan.starts, plan.counts, plan.prefill_indptr, plan.prefill_slots,
                               plan.window, scale, out, tiles=tiles)
    return out


def scatter_slots(seqs, seed):
    """The same slices reading their tokens through one shuffled slot list: no block's slots run
    in page order, so the tile path copies every key it multiplies (and the reference reads the
    same shuffled K and V)."""
    g = torch.Generator().manual_seed(seed)
    return [SequenceSlice(s.query_start, s.query_end, s.slots[torch.randperm(len(s.slots), generator=g)], s.mask)
            for s in seqs]


@pytest.mark.skipif(not native.tile_products(), reason="no AMX tile units here (or no AVX-512 build)")
@pytest.mark.parametrize("window", [0, 20], ids=["causal", "window"])
@pytest.mark.parametrize("order", ["pages", "scattered"])
@pytest.mark.parametrize("dim,heads,kv_heads", [(64, 12, 4), (128, 8, 2), (32, 4, 4), (96, 6, 2)])
def test_bfloat16_prefill_on_amx_tiles_equals_the_reference_and_keeps_each_rows_bits(dim, heads, kv_heads, order,
                                                                                     window):
    """On the tile units: the scores of 16 keys a tile (a page's slots in place, or copied where a
    block's slots are out of order), the window's first block from a page boundary, P.V from the
    weights rounded to bfloat16, V paired once for the call where a prompt has several tiles. Each
    row's result is the same bits computed beside other chunks or on one thread or four. (Tall
    tiles: test_prefill_kernel_in_tall_tiles_equals_the_reference.)"""
    # a long prompt beside them: V paired once for the call on every thread (dozens of blocks)
    q, kc, vc, seqs, _ = build_case(PREFILLS + [(1100, 1100)], heads=heads, kv_heads=kv_heads, dim=dim,
                                    num_pages=170, seed=dim, window=window or None)
    if order == "scattered":
        seqs = scatter_slots(seqs, dim)
    seqs = [s for s in seqs if s.num_queries > 1]
    q, kc, vc = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    scale = dim**-0.5
    out = prefill_on_tiles(q, kc, vc, seqs, scale, window)
    rows = torch.cat([torch.arange(s.query_start, s.query_end) for s in seqs])
    ref = paged_attention_reference(q.double(), kc.double(), vc.double(), seqs, scale=scale,
                                    sliding_window=window or None)
    assert (out.double() - ref)[rows].abs().max() <= (ref.abs().max() * 2 ** -7).item()
    vectors = prefill_on_tiles(q, kc, vc, seqs, scale, window, tiles=False)
    assert (out.double() - vectors.double())[rows].abs().max() <= (ref.abs().max() * 2 ** -7).item()
    assert not torch.equal(out[rows], vectors[rows])  # the tile path ran (its sums are in another order)
    alone = next(s for s in seqs if s.num_queries == 300)
    moved = SequenceSlice(0, alone.num_queries, alone.slots, alone.mask)
    by_itself = prefill_on_tiles(q[alone.query_start : alone.query_end].contiguous(), kc, vc, [moved], scale, window)
    assert torch.equal(by_itself, out[alone.query_start : alone.query_end])
    threads = torch.get_num_threads()
    try:
        for n in (1, 4):
            torch.set_num_threads(n)
            assert torch.equal(prefill_on_tiles(q, kc, vc, seqs, scale, window)[rows], out[rows])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not native.tile_products(), reason="no AMX tile units here (or no AVX-512 build)")
@pytest.mark.parametrize("nats_per_key", [0.05, 0.8, -0.8])
def test_bfloat16_prefill_on_amx_tiles_holds_when_scores_climb_hundreds_of_nats(nats_per_key):
    """The tile path moves a row's reference max only when a block's scores pass it by more than 8
    nats. Scores that climb along the keys (passing the max within a few blocks, or in every block
    by about 50 nats), or fall, span hundreds of nats; the result stays the reference's."""
    dim = 64
    q, kc, vc, seqs, _ = build_case([(600, 77), (300, 300)], heads=8, kv_heads=2, dim=dim, num_pages=64, seed=16)
    for s in seqs:  # key t scores about t * nats_per_key against a query of ones
        kc[s.slots] = (torch.arange(s.context_len) * nats_per_key / dim**0.5)[:, None, None].expand(-1, 2, dim)
    q = torch.ones_like(q) + 0.01 * q
    q, kc, vc = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    out = prefill_on_tiles(q, kc, vc, seqs, dim**-0.5)
    ref = paged_attention_reference(q.double(), kc.double(), vc.double(), seqs, scale=dim**-0.5)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() <= (ref.abs().max() * 2 ** -7).item()


def test_prefill_kernel_keeps_to_the_sliding_window_given_or_read_from_the_masks():
    q, kc, vc, seqs, _ = build_case([(60, 12), (90, 90), (40, 1), (25, 25)], dim=64, seed=12, window=20)
    ref = paged_attention_reference(q, kc, vc, seqs, scale=0.2, sliding_window=20)
    for plan in (AttentionPlan(seqs, sliding_window=20), AttentionPlan(seqs)):
        assert plan.window == 20
        torch.testing.assert_close(plan(q, kc, vc, 0.2), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dim", [16, 64])
def test_prefill_kernel_is_exact_when_scores_span_hundreds_of_nats(dim):
    q, kc, vc, seqs, _ = build_case(PREFILLS, heads=8, kv_heads=2, dim=dim, num_pages=96, seed=13)
    q = q * 60
    exact = paged_attention_reference(q.double(), kc.double(), vc.double(), seqs, scale=dim**-0.5)
    torch.testing.assert_close(AttentionPlan(seqs)(q, kc, vc, dim**-0.5).double(), exact, atol=2e-4, rtol=2e-4)


def test_head_sizes_without_prefill_tiles_take_torchs_attention():
    q, kc, vc, seqs, _ = build_case([(37, 37), (70, 22)], heads=4, kv_heads=2, dim=24, seed=14)
    ref = paged_attention_reference(q, kc, vc, seqs, scale=0.2)
    torch.testing.assert_close(AttentionPlan(seqs)(q, kc, vc, 0.2), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(native.prefill_attention() is None, reason="no C++ compiler here")
@pytest.mark.parametrize("case", ["slot past the cache", "rows past q", "count past context", "odd head size"])
def test_prefill_kernel_refuses_indices_it_would_read_out_of_bounds(case):
    q, kc, vc, seqs, _ = build_case([(37, 37)], heads=4, kv_heads=2, dim=32, seed=15)
    starts, counts = torch.tensor([0]), torch.tensor([37])
    indptr, slots = torch.tensor([0, 37]), seqs[0].slots.clone()
    if case == "slot past the cache":
        slots[5] = kc.shape[0]
    elif case == "rows past q":
        starts = torch.tensor([1])
    elif case == "count past context":
        counts = torch.tensor([38])
    else:
        q, kc, vc = q[..., :24].contiguous(), kc[..., :24].contiguous(), vc[..., :24].contiguous()
    with pytest.raises(RuntimeError):
        native.prefill_attention()(q, kc, vc, starts, counts, indptr, slots, 0, 0.2, torch.empty_like(q))


def test_a_lock_left_by_a_killed_build_is_cleared_and_a_live_one_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    native._clear_stale_lock(tmp_path)
    assert lock.exists()  # another process may be building right now
    old = time.time() - native._STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    native._clear_stale_lock(tmp_path)
    assert not lock.exists()  # torch would otherwise wait on it forever


def test_a_start_that_finds_a_build_under_way_waits_for_it_and_not_past_its_death(tmp_path, monkeypatch):
    """A process that finds another's build lock waits until the builder is done with it (the
    library may be on disk, half linked, before), and where the builder died, until the lock turns
    stale, which it then removes to build itself, where torch's builder would have waited forever."""
    import threading

    built = tmp_path / "kvmesh.so"
    lock = tmp_path / "lock"
    lock.touch()
    built.touch()  # the library being linked: not to be loaded yet

    def finish():  # the other process's build completes and lets go of the lock
        built.write_bytes(b"linked")
        lock.unlink()

    finished = threading.Timer(0.2, finish)
    finished.start()
    native._wait_for_other_build(tmp_path, poll_s=0.01)
    assert built.read_bytes() == b"linked" and not lock.exists()
    finished.join()

    built.unlink()
    monkeypatch.setattr(native, "_STALE_LOCK_S", 0.3)
    lock.touch()  # a fresh lock whose builder is gone: it turns stale while this process waits
    native._wait_for_other_build(tmp_path, poll_s=0.01)
    assert not lock.exists() and not built.exists()


def test_the_decode_kernel_refuses_slots_outside_the_cache_instead_of_reading_them():
    op = native.decode_attention()
    if op is None:
        pytest.skip("the decode kernel is not built here")
    q, kc, vc = torch.randn(1, 4, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    out = torch.empty_like(q)
    rows, indptr = torch.tensor([0]), torch.tensor([0, 2])
    with pytest.raises(RuntimeError, match="outside the cache"):
        op(q, kc, vc, rows, indptr, torch.tensor([3, 8]), 0.25, out)
    with pytest.raises(RuntimeError, match="indptr must span"):
        op(q, kc, vc, rows, indptr, torch.tensor([3]), 0.25, out)
    op(q, kc, vc, rows, indptr, torch.tensor([3, 7]), 0.25, out)  # in range: fine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_write_puts_each_row_at_its_slot_from_a_fused_projection(dtype):
    """K and V come out of the fused q|k|v projection as strided views; the row copy stores them
    where index_copy_ would, and touches no other slot."""
    if native.write_kv() is None:
        pytest.skip("kvmesh's C++ kernels are not built here")
    g = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, dim = 37, 6, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    slots = torch.randperm(256, generator=g)[:tokens]
    kc, vc = torch.randn(256, kv_heads, dim, generator=g).to(dtype), torch.randn(256, kv_heads, dim, generator=g).to(dtype)
    want_k, want_v = kc.clone().index_copy_(0, slots, k), vc.clone().index_copy_(0, slots, v)
    native.write_kv()(kc, vc, slots, k, v)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_the_kv_write_refuses_a_slot_outside_the_cache_and_writes_nothing():
    op = native.write_kv()
    if op is None:
        pytest.skip("kvmesh's C++ kernels are not built here")
    kc, vc = torch.zeros(8, 2, 16), torch.zeros(8, 2, 16)
    rows = torch.ones(2, 2, 16)
    with pytest.raises(RuntimeError, match="slot 8 is outside the cache of 8"):
        op(kc, vc, torch.tensor([3, 8]), rows, rows)
    with pytest.raises(RuntimeError, match="slot -1 is outside"):
        op(kc, vc, torch.tensor([-1, 0]), rows, rows)
    with pytest.raises(RuntimeError, match="one slot per token"):
        op(kc, vc, torch.tensor([3]), rows, rows)
    assert kc.abs().sum() == 0 and vc.abs().sum() == 0
    # rows whose heads are not contiguous go through index_copy_ instead
    rows_t = torch.ones(2, 16, 2).transpose(1, 2)
    write_kv(kc, vc, torch.tensor([1, 2]), rows_t, rows_t)
    assert kc[1:3].eq(1).all() and kc[0].eq(0).all() and kc[3:].eq(0).all()


def _fused():
    ops = native.fused_ops()
    if ops is None:
        pytest.skip("kvmesh's C++ kernels are not built here")
    return ops


# Row counts: one (a decode step of one sequence, on the calling thread), a few, and enough to be
# split between threads; widths: vector multiples and a tail (172 = 10 vectors of 16 + 12).
FUSED_ROWS = [1, 7, 300]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", FUSED_ROWS)
def test_fused_rotary_equals_transformers_operators_bit_for_bit(dtype, rows):
    """In place on q and k as they sit in the fused q|k|v projection (a strided view), equal to
    x * cos + rotate_half(x) * sin computed by torch's operators in the same dtype."""
    ops = _fused()
    g = torch.Generator().manual_seed(rows)
    heads, kv_heads, dim = 12, 4, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    qk = qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
    angles = torch.randn(rows, dim // 2, generator=g) * 50
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    rotate_half = torch.cat((-qk[..., dim // 2 :], qk[..., : dim // 2]), dim=-1)
    want = qk * cos[:, None] + rotate_half * sin[:, None]
    signed_sin = torch.cat((-sin[:, : dim // 2], sin[:, dim // 2 :]), dim=-1)
    ops.rotary_(qk, cos, signed_sin)
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # V, beside them, untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", FUSED_ROWS)
@pytest.mark.parametrize("width", [2048, 172])
def test_fused_silu_mul_equals_transformers_operators(dtype, rows, width):
    """silu(gate) * up, each rounded to the dtype as transformers' two operators round it: equal bit
    for bit, except that float32 tails (past the last full vector of a row) may differ in the last
    bits (one unit of silu's, carried through the product), torch computing them with the C
    library's exp."""
    ops = _fused()
    g = torch.Generator().manual_seed(width + rows)
    gate_up = (torch.randn(rows, 2 * width, generator=g) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want, got = F.silu(gate) * up, ops.silu_mul(gate_up)
    assert got.shape == (rows, width) and got.dtype == dtype
    if dtype == torch.float32 and width % 16:
        full = width - width % 16
        assert torch.equal(got[:, :full], want[:, :full])
        torch.testing.assert_close(got, want, rtol=2 * torch.finfo(dtype).eps, atol=1e-30)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", FUSED_ROWS)
def test_fused_rms_norm_rounds_where_transformers_rounds(dtype, rows):
    """transformers' LlamaRMSNorm in half precision: normalized in float32, rounded, then scaled by
    the weight in the dtype. Rows are summed in another order than torch's mean, so a value on a
    rounding boundary may land one unit of the last place away before it is scaled: at most 1% of
    values, by at most two units of the result's last place."""
    ops = _fused()
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 768, generator=g) * 3).to(dtype)
    w = torch.randn(768, generator=g).to(dtype)
    h = x.float()
    want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    got = ops.rms_norm(x, w, 1e-6)
    differ = got != want
    assert differ.float().mean() <= 0.01
    ulp = torch.finfo(dtype).eps * want.float().abs()
    assert ((got.float() - want.float()).abs()[differ] <= 2 * ulp[differ]).all()
    # strided rows (every other row of a larger tensor) read where they are
    assert torch.equal(ops.rms_norm(x[::2], w, 1e-6), got[::2])


@pytest.mark.parametrize("rows", FUSED_ROWS)
def test_fused_rms_norm_in_float32_is_transformers_up_to_the_order_of_the_sum(rows):
    """transformers' float32 LlamaRMSNorm is six torch operators; the fused one sums a row in
    another order and takes 1 / sqrt where torch takes rsqrt, so a row's scale factor may be one
    unit of the last place away; the two roundings after it (x times the scale, then the weight)
    are the same operations as torch's, so each value is within three units of the last place
    relative to its size."""
    ops = _fused()
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 768, generator=g) * 3
    w = torch.randn(768, generator=g)
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    got = ops.rms_norm(x, w, 1e-6)
    assert got.dtype == torch.float32
    assert ((got - want).abs() <= 3 * torch.finfo(torch.float32).eps * want.abs()).all()


def test_fused_operators_refuse_what_they_cannot_compute():
    ops = _fused()
    with pytest.raises(RuntimeError, match="silu_mul: gate_up must have an even number of columns"):
        ops.silu_mul(torch.ones(2, 5))
    with pytest.raises(RuntimeError, match="dtype must be float32, bfloat16 or float16"):
        ops.silu_mul(torch.ones(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"rotary_: cos and sin must be \[tokens, head_dim\] = \[3, 8\]"):
        ops.rotary_(torch.ones(3, 2, 8), torch.ones(2, 8), torch.ones(3, 8))
    with pytest.raises(RuntimeError, match="rms_norm: weight must be contiguous with x's 8 columns"):
        ops.rms_norm(torch.ones(3, 8, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="last dimension must be contiguous"):
        ops.silu_mul(torch.ones(8, 4).t())


@pytest.mark.parametrize("rows", FUSED_ROWS)
@pytest.mark.parametrize("vocab", [1, 17, 172, 32000])
def test_greedy_pick_is_torchs_argmax_and_log_softmax(rows, vocab):
    """The sampler's greedy pick: torch.argmax's ids (the first of equal maxima too) and, as the
    pick's logprob, its logit minus the logsumexp: log_softmax's value to a few units of float32."""
    ops = _fused()
    g = torch.Generator().manual_seed(rows * 7 + vocab)
    logits = torch.randn(rows, vocab, generator=g) * 8
    logits[:, vocab // 2] = logits[:, -1] = logits.max(dim=1).values + 1  # a tie: the first one wins
    ids, lse = ops.greedy_pick(logits)
    assert torch.equal(ids, logits.argmax(dim=-1))
    picked = logits.gather(1, ids[:, None])[:, 0] - lse
    want = torch.log_softmax(logits, dim=-1).gather(1, ids[:, None])[:, 0]
    torch.testing.assert_close(picked, want, atol=4e-6, rtol=0)
    assert lse.dtype == torch.float32 and ids.dtype == torch.long and ids.shape == (rows,)


def test_greedy_pick_gives_a_row_with_a_nan_a_nan_logsumexp():
    ops = _fused()
    logits = torch.zeros(3, 100)
    logits[1, 40] = float("nan")
    logits[2, 7] = float("inf")
    _, lse = ops.greedy_pick(logits)
    assert lse[0] == pytest.approx(math.log(100)) and lse[1].isnan() and not lse[2].isfinite()
    with pytest.raises(RuntimeError, match="greedy_pick: logits must be float32"):
        ops.greedy_pick(torch.zeros(2, 4, dtype=torch.bfloat16))


def _draw_by_torch(scaled, uniforms):
    """The sampler's walk in torch's operators (its path without the C++ library)."""
    cdf = scaled.double().softmax(dim=-1).cumsum(dim=-1)
    total = cdf[:, -1]
    target = torch.minimum(uniforms.double() * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target[:, None], right=True)[:, 0]


@pytest.mark.parametrize("vocab", [1, 17, 172, 32000])
def test_draw_takes_the_token_whose_cumulative_probability_passes_the_uniform(vocab):
    """The sampler's draw: for each row and uniform u, the first token (in vocabulary order) whose
    cumulative probability passes u, as softmax, cumsum and searchsorted find it; tokens removed
    by top-k or top-p (-inf) are never drawn, and u = 0 and u just below 1 give the first and last
    tokens that can be drawn."""
    ops = _fused()
    g = torch.Generator().manual_seed(vocab)
    rows = 300
    scaled = torch.randn(rows, vocab, generator=g) * 3
    removed = torch.rand(rows, vocab, generator=g) < 0.5
    removed[:, 0] = False  # at least one token left in each row
    scaled[removed] = float("-inf")
    uniforms = torch.rand(rows, generator=g)
    uniforms[:3] = torch.tensor([0.0, 1 - 2**-24, 0.5])
    ids, totals = ops.draw(scaled, uniforms)
    assert ids.dtype == torch.long and totals.dtype == torch.float64
    assert torch.equal(ids, _draw_by_torch(scaled, uniforms))
    assert not removed.gather(1, ids[:, None]).any()
    allowed = (~removed[0]).nonzero().flatten()
    assert ids[0] == allowed[0] and ids[1] == (~removed[1]).nonzero().flatten()[-1]
    assert torch.isfinite(totals).all() and (totals >= 1).all()  # the largest term is exp(0)


def test_draw_reports_rows_whose_probabilities_are_not_finite():
    ops = _fused()
    scaled = torch.zeros(3, 40)
    scaled[1, 7] = float("nan")
    scaled[2] = float("-inf")
    _, totals = ops.draw(scaled, torch.full((3,), 0.5))
    assert totals[0] == 40 and totals[1].isnan() and not totals[2].isfinite()
    with pytest.raises(RuntimeError, match="draw: uniforms must be a contiguous float32 vector of one number per row"):
        ops.draw(scaled, torch.zeros(2))
