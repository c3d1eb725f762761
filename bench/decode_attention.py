"""Decode attention alone: one layer's call for a step of decoding sequences, kernel against torch.

    cd bench && ../.venv/bin/python decode_attention.py [SEQUENCES [MEAN_CONTEXT [THREADS [HEADS,KV_HEADS,DIM [SHARED]]]]]

The benchmark model's shapes by default (12 query heads, 4 KV heads of 64; the cheap model's are
4,2,16), pages of 16 scattered over the pool, contexts uniform in [mean/2, 3*mean/2] (seed 0). Prints milliseconds per call (median of
25 after 3 warm-up calls, CPU time of the calling process, which a busy machine inflates less
than wall time) for kvmesh's C++ kernel and for torch's SDPA per sequence, in float32 and
bfloat16, and the bytes of K and V the step reads per millisecond. With SHARED > 0 every sequence
begins with the same SHARED tokens' pages (a cached system prompt) and has MEAN_CONTEXT tokens of its
own after them (uniform in [mean/2, 3*mean/2] as above); the bytes counted are what the sequences
see, the shared pages once per sequence.

A case meant to read K and V from memory must be larger than the last-level cache in both
dtypes: bfloat16's are half float32's bytes (112 sequences of about 320 tokens are 73 MB in
float32 and 37 MB in bfloat16, partly in a 32 MiB L3; about 640 tokens, 73 MB in bfloat16).
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch


def case(num_seqs: int, mean: int, dtype: torch.dtype, heads=12, kv_heads=4, dim=64, page=16, shared=0):
    from kvmesh.kernels.attention import SequenceSlice

    rng = random.Random(0)
    lengths = [rng.randint(mean // 2, 3 * mean // 2) for _ in range(num_seqs)]
    shared = shared // page * page
    pages_needed = [-(-n // page) for n in lengths]
    order = list(range(shared // page + sum(pages_needed)))
    rng.shuffle(order)  # pages scattered over the pool, as after a while of serving
    k = torch.randn(len(order) * page, kv_heads, dim).to(dtype)
    v = torch.randn(len(order) * page, kv_heads, dim).to(dtype)
    q = torch.randn(num_seqs, heads, dim).to(dtype)
    seqs, at = [], shared // page
    for i, n in enumerate(lengths):
        pages = torch.tensor(order[: shared // page] + order[at : at + pages_needed[i]])
        at += pages_needed[i]
        slots = (pages[:, None] * page + torch.arange(page)).flatten()[: shared + n]
        seqs.append(SequenceSlice(i, i + 1, slots, None))
    return q, k, v, seqs, (sum(lengths) + shared * num_seqs) * kv_heads * dim * 2 * k.element_size()


def timed(fn, repeats=25, warmups=3, clock=time.process_time) -> float:
    """Median seconds of `fn` by `clock` (default: the process's CPU time) after `warmups` calls."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def main() -> None:
    from kvmesh.kernels import native
    from kvmesh.kernels.attention import AttentionPlan

    num_seqs = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    mean = int(sys.argv[2]) if len(sys.argv) > 2 else 600
    torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    heads, kv_heads, dim = (int(x) for x in (sys.argv[4] if len(sys.argv) > 4 else "12,4,64").split(","))
    shared = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    print(f"{num_seqs} decoding sequences, contexts around {mean}" + (f" after a shared prefix of {shared}" if shared else "")
          + f", {torch.get_num_threads()} thread(s), {heads} query heads over {kv_heads} KV heads of {dim}")
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, seqs, nbytes = case(num_seqs, mean, dtype, heads=heads, kv_heads=kv_heads, dim=dim, shared=shared)
        plan = AttentionPlan(seqs)
        assert native.decode_attention() is not None and len(plan.decodes) == num_seqs
        kernel = timed(lambda: plan(q, k, v, 0.125))
        native.decode_attention.cache_clear()
        original = native.decode_attention
        native.decode_attention = lambda: None
        per_sequence = AttentionPlan(seqs)
        sdpa = timed(lambda: per_sequence(q, k, v, 0.125))
        native.decode_attention = original
        print(f"{str(dtype).removeprefix('torch.'):>9}: kernel {1000 * kernel:6.2f} ms ({nbytes / kernel / 1e9:5.1f} GB/s of K+V), "
              f"SDPA per sequence {1000 * sdpa:6.2f} ms", flush=True)


if __name__ == "__main__":
    main()
