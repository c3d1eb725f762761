"""Prefill attention alone: one layer's call for a step's prefill chunks, kernel against torch.

    cd bench && ../.venv/bin/python prefill_attention.py [THREADS]

The benchmark model's shapes (12 query heads, 4 KV heads of 64), pages of 16 scattered over the
pool (seed 0). Each case is one step's prefill chunks as (context length, new tokens): a chunk
from position 0, a chunk after a cached prefix, several prompts in one step. Prints
milliseconds per call (median of 15 after 2 warm-up calls, wall time) for kvmesh's C++ prefill
kernel and for torch's SDPA per sequence (what the CPU path took before), in float32 and
bfloat16, and the kernel's GFLOP/s (the causal products Q.K and P.V); where the CPU has AMX,
bfloat16 also by the kernel's vector path (AVX512-BF16) with the tile units turned off.
"""

from __future__ import annotations

import random
import sys
import time

import torch

import decode_attention  # bench/: its timer

CASES = [[(64, 64)], [(256, 256)], [(512, 512)], [(1024, 1024)], [(1024, 512)], [(300, 300), (200, 200), (500, 500)]]


def case(layout, dtype: torch.dtype, heads=12, kv_heads=4, dim=64, page=16):
    from kvmesh.kernels.attention import SequenceSlice, causal_mask

    rng = random.Random(0)
    pages_needed = [-(-ctx // page) for ctx, _ in layout]
    order = list(range(sum(pages_needed)))
    rng.shuffle(order)
    k = torch.randn(len(order) * page, kv_heads, dim).to(dtype)
    v = torch.randn(len(order) * page, kv_heads, dim).to(dtype)
    q = torch.randn(sum(nq for _, nq in layout), heads, dim).to(dtype)
    seqs, at, row, flops = [], 0, 0, 0
    for (ctx, nq), n in zip(layout, pages_needed):
        pages = torch.tensor(order[at : at + n])
        at += n
        slots = (pages[:, None] * page + torch.arange(page)).flatten()[:ctx]
        seqs.append(SequenceSlice(row, row + nq, slots, causal_mask(nq, ctx)))
        row += nq
        seen = sum(ctx - nq + i + 1 for i in range(nq))  # keys each query sees, summed
        flops += 2 * 2 * seen * dim * heads
    return q, k, v, seqs, flops


def timed(fn) -> float:
    """Median wall seconds of 15 calls after 2 (the threads' work is the point here, not one core's)."""
    return decode_attention.timed(fn, repeats=15, warmups=2, clock=time.perf_counter)


def main() -> None:
    from kvmesh.kernels import native
    from kvmesh.kernels.attention import AttentionPlan

    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    print(f"{torch.get_num_threads()} thread(s); (context, new tokens) per chunk")
    for layout in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v, seqs, flops = case(layout, dtype)
            kernel_plan = AttentionPlan(seqs)
            assert native.prefill_attention() is not None and len(kernel_plan.prefills) == len(seqs)
            kernel = timed(lambda: kernel_plan(q, k, v, 0.125))
            sdpa_plan = AttentionPlan(seqs, use_kernel=False)
            sdpa = timed(lambda: sdpa_plan(q, k, v, 0.125))
            vectors = ""
            if dtype == torch.bfloat16 and native.tile_products():  # the kernel's path without the tile units
                out = torch.empty_like(q)
                p = kernel_plan
                ms = timed(lambda: native.prefill_attention()(q, k, v, p.starts, p.counts, p.prefill_indptr,
                                                               p.prefill_slots, 0, 0.125, out, tiles=False))
                vectors = f", kernel without AMX tiles {1000 * ms:7.2f} ms ({ms / kernel:4.2f}x)"
            print(f"{str(layout):38} {str(dtype).removeprefix('torch.'):>9}: kernel {1000 * kernel:7.2f} ms "
                  f"({flops / kernel / 1e9:5.1f} GFLOP/s), "
                  f"SDPA per sequence {1000 * sdpa:7.2f} ms ({sdpa / kernel:4.2f}x){vectors}", flush=True)


if __name__ == "__main__":
    main()
