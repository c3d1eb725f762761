"""Decode attention over a shared prefix as a decode step meets it: twelve layers' calls, each
layer's K and V pool of its own, and a layer's worth of weights (28 MB, the benchmark model's in
float32) read between calls, so the shared pages are not all left in cache by the previous layer.

    cd bench && ../.venv/bin/python shared_prefix_decode.py [THREADS:SEQUENCES ...]

SEQUENCES decoding sequences (default pairs 1:8 1:32 2:8 2:32) each see the same 1,024-token
prefix's pages and about 64 tokens of their own (32-96); the benchmark model's heads (12 over 4 of
64). Prints the median of 9 steps of the twelve calls' wall time, float32 and bfloat16. To compare
kernels, run it with another checkout first on PYTHONPATH.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import decode_attention  # bench/: its case


def main() -> None:
    from kvmesh.kernels.attention import AttentionPlan

    pairs = [tuple(int(x) for x in a.split(":")) for a in sys.argv[1:]] or [(1, 8), (1, 32), (2, 8), (2, 32)]
    weights = torch.randn(7_000_000)
    for threads, num_seqs in pairs:
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v, seqs, _ = decode_attention.case(num_seqs, 64, dtype, shared=1024)
            layers = [(k.clone(), v.clone()) for _ in range(12)]
            plan = AttentionPlan(seqs)

            def step() -> float:
                spent = 0.0
                for k_cache, v_cache in layers:
                    weights.sum()  # the layer's products read their weights
                    t0 = time.perf_counter()
                    plan(q, k_cache, v_cache, 0.125)
                    spent += time.perf_counter() - t0
                return spent

            step()
            ms = 1000 * statistics.median(step() for _ in range(9))
            print(f"{threads} thread(s), {num_seqs:3d} sequences, {str(dtype).removeprefix('torch.'):>9}: "
                  f"{ms:6.2f} ms of attention a step (12 layers)", flush=True)


if __name__ == "__main__":
    main()
