"""Paged attention in Triton: the GPU path over page tables.

The cache layout is kvmesh's (`kernels/attention.py`): one layer's K or V is
`[num_pages * page_size, kv_heads, head_dim]`, and a sequence's page table lists its pages in
order, so position `p` lives in slot `table[p // page_size] * page_size + p % page_size`.
RoPE is applied before the cache write (the model does), so the kernels read rotated K.

- `decode_attention`: one query per sequence. Flash-decoding: each (sequence, KV head, split)
  program reads its share of the context once for the whole GQA group of query heads, keeps an
  online softmax in base 2, and writes a partial result; a second kernel merges the splits. A
  long context is cut into more splits so one sequence still fills the device.
- `prefill_attention`: chunks of queries at the last positions of their sequences (a fresh prompt,
  or a chunk after a cached prefix), causal, tiled over queries and over the cached KV.

Both take a sliding window (Mistral): a query at position p sees positions p - window + 1 .. p.
Scores and the softmax are float32 whatever the cache's dtype; float32 products are IEEE (no
TF32) so float32 greedy output can match transformers.

CPU CI runs them with Triton's interpreter (`TRITON_INTERPRET=1`, set before this module is
imported) against `paged_attention_reference`; the interpreter has no bfloat16, so it runs
float32 and float16 there, and bfloat16 is checked on a GPU (`pytest -m cuda`).
"""

from __future__ import annotations

import triton
import triton.language as tl
import torch

# Finite stand-in for -inf in the running maximum: a row that has seen only masked positions
# keeps l = 0 and acc = 0 without producing exp(-inf - -inf) = nan.
_NEG_BIG = -1.0e30
_LOG2E = 1.4426950408889634


@triton.jit
def _load_kv(k_ptr, v_ptr, tables_ptr, seq, stride_table, tok, t_ok, kv_head, d, d_ok,
             stride_ks, stride_kh, stride_vs, stride_vh, PAGE_SIZE: tl.constexpr):
    """K and V rows of positions `tok` (masked by t_ok) of sequence `seq`, through its page table."""
    page = tl.load(tables_ptr + seq * stride_table + tok // PAGE_SIZE, mask=t_ok, other=0)
    slot = page.to(tl.int64) * PAGE_SIZE + tok % PAGE_SIZE
    kv_mask = t_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _softmax_step(qk, v, m_i, l_i, acc):
    """One tile of the online softmax (base 2): `qk` are the tile's scores (-inf where not seen)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, rows_ptr, tables_ptr, context_lens_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    qk_scale, window, tokens_per_split,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_table,
    stride_pa_s, stride_pa_h, stride_pa_p, stride_pm_s, stride_pm_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    row = tl.load(rows_ptr + seq)
    lo = split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, ctx)
    if window > 0:
        lo = tl.maximum(lo, ctx - window)

    g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)
        t_ok = tok < hi
        k, v = _load_kv(k_ptr, v_ptr, tables_ptr, seq, stride_table, tok, t_ok, kv_head, d, d_ok,
                        stride_ks, stride_kh, stride_vs, stride_vh, PAGE_SIZE)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        qk = tl.where(t_ok[None, :], qk, float("-inf"))
        m_i, l_i, acc = _softmax_step(qk, v, m_i, l_i, acc)

    out_mask = g_ok[:, None] & d_ok[None, :]
    pa = part_acc_ptr + seq * stride_pa_s + heads[:, None] * stride_pa_h + split * stride_pa_p + d[None, :]
    tl.store(pa, acc, mask=out_mask)
    pm = seq * stride_pm_s + heads * stride_pm_h + split
    tl.store(part_m_ptr + pm, m_i, mask=g_ok)
    tl.store(part_l_ptr + pm, l_i, mask=g_ok)


@triton.jit
def _decode_merge_kernel(
    out_ptr, rows_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, num_splits,
    stride_ot, stride_oh, stride_pa_s, stride_pa_h, stride_pa_p, stride_pm_s, stride_pm_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(rows_ptr + seq)
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    p_ok = p < num_splits
    d_ok = d < HEAD_DIM
    pm = seq * stride_pm_s + head * stride_pm_h + p
    m = tl.load(part_m_ptr + pm, mask=p_ok, other=_NEG_BIG)
    l = tl.load(part_l_ptr + pm, mask=p_ok, other=0.0)
    acc = tl.load(part_acc_ptr + seq * stride_pa_s + head * stride_pa_h + p[:, None] * stride_pa_p + d[None, :],
                  mask=p_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    total = tl.sum(l * w, 0)
    o = tl.sum(acc * w[:, None], 0) / total
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, q_starts_ptr, q_lens_ptr, tables_ptr, context_lens_ptr,
    qk_scale, window,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_table,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_len = tl.load(q_lens_ptr + seq)
    if block * BLOCK_M >= q_len:
        return
    kv_head = head // GROUP
    q_start = tl.load(q_starts_ptr + seq)
    ctx = tl.load(context_lens_ptr + seq)
    m_idx = block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m_idx < q_len
    q_pos = ctx - q_len + m_idx
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + m_idx)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)

    last = tl.minimum(ctx - q_len + (block + 1) * BLOCK_M, ctx)  # one past the block's last query position
    lo = 0
    if window > 0:
        lo = tl.maximum(ctx - q_len + block * BLOCK_M - window + 1, 0)
        lo = lo - lo % BLOCK_N
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(lo, last, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)
        t_ok = tok < last
        k, v = _load_kv(k_ptr, v_ptr, tables_ptr, seq, stride_table, tok, t_ok, kv_head, d, d_ok,
                        stride_ks, stride_kh, stride_vs, stride_vh, PAGE_SIZE)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        visible = t_ok[None, :] & (tok[None, :] <= q_pos[:, None])
        if window > 0:
            visible = visible & (tok[None, :] > q_pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
        m_i, l_i, acc = _softmax_step(qk, v, m_i, l_i, acc)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + m_idx)[:, None] * stride_ot + head * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def _dims(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int, int]:
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    return heads, kv_heads, dim


def _block_d(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


# A split reads at least this many tokens: below it, the merge costs more than the parallelism gains.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32


def num_splits(max_context: int, num_seqs: int, kv_heads: int, target_programs: int = 264) -> int:
    """Splits per sequence: enough (sequence, KV head, split) programs to fill the device's
    multiprocessors about twice (132 on an H200), each split reading at least MIN_SPLIT_TOKENS."""
    wanted = max(1, -(-target_programs // max(1, num_seqs * kv_heads)))
    by_length = max(1, max_context // MIN_SPLIT_TOKENS)
    return min(wanted, by_length, MAX_SPLITS)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    rows: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor,
    scale: float, page_size: int, max_context: int, window: int | None = None, splits: int | None = None,
) -> None:
    """Writes attention for the decode rows `rows` (one query each) of `q` `[tokens, heads, dim]`
    into the same rows of `out`. `tables` `[seqs, max_pages]` int32 and `context_lens` `[seqs]`
    describe each sequence; `max_context` bounds the lengths (it sizes the splits)."""
    heads, kv_heads, dim = _dims(q, k_cache)
    n = rows.shape[0]
    if n == 0:
        return
    group = heads // kv_heads
    splits = splits or num_splits(max_context, n, kv_heads)
    tokens_per_split = -(-max_context // splits)
    tokens_per_split = -(-tokens_per_split // page_size) * page_size
    splits = -(-max_context // tokens_per_split)
    part_acc = torch.empty(n, heads, splits, dim, dtype=torch.float32, device=q.device)
    part_m = torch.empty(n, heads, splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    block_d = _block_d(dim)
    _decode_split_kernel[(n, kv_heads, splits)](
        q, k_cache, v_cache, rows, tables, context_lens, part_acc, part_m, part_l,
        scale * _LOG2E, window or 0, tokens_per_split,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        tables.stride(0), part_acc.stride(0), part_acc.stride(1), part_acc.stride(2), part_m.stride(0), part_m.stride(1),
        HEAD_DIM=dim, BLOCK_D=block_d, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        PAGE_SIZE=page_size, BLOCK_N=max(16, page_size),
    )
    _decode_merge_kernel[(n, heads)](
        out, rows, part_acc, part_m, part_l, splits,
        out.stride(0), out.stride(1), part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_m.stride(0), part_m.stride(1),
        HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_P=triton.next_power_of_2(splits),
    )


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    q_starts: torch.Tensor, q_lens: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor,
    scale: float, page_size: int, max_queries: int, window: int | None = None, block_m: int = 64,
) -> None:
    """Writes attention for prefill chunks: sequence i's queries are rows `q_starts[i] ..
    q_starts[i] + q_lens[i] - 1` of `q`, at its last `q_lens[i]` positions of `context_lens[i]`."""
    heads, kv_heads, dim = _dims(q, k_cache)
    n = q_starts.shape[0]
    if n == 0:
        return
    block_m = max(16, min(block_m, triton.next_power_of_2(max_queries)))
    grid = (triton.cdiv(max_queries, block_m), n, heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, q_starts, q_lens, tables, context_lens,
        scale * _LOG2E, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), tables.stride(0),
        HEAD_DIM=dim, BLOCK_D=_block_d(dim), GROUP=heads // kv_heads, PAGE_SIZE=page_size,
        BLOCK_M=block_m, BLOCK_N=max(16, page_size) if block_m <= 16 else max(32, page_size),
    )
