"""Matrix products by rows: the few-rows kernel against oneDNN's, over a model's layers in turn.

    cd bench && ../.venv/bin/python linear_rows.py [DTYPE [ROWS,ROWS,...]]

The benchmark model's shapes (twelve layers of q|k|v 1280x768, o 768x768, gate|up 4096x768, down
768x2048), each layer its own weights, all twelve called in turn as a forward pass does, so each
layer's weights were evicted by the others' (151 MB in bfloat16, 302 MB in float32, past any
cache here). For each row count: milliseconds per pass (the second best of 7 after 2 warm-up
passes, wall time), GFLOP/s and the weights' GB/s, with oneDNN's packed weights
(`PackedLinear` without the copy) and with kvmesh's few-rows kernel (`kernels/csrc/small_linear.cpp`,
which `PackedLinear` takes up to `SMALL_ROWS` rows; here at every row count, to show where the
threshold falls). Two torch threads unless KVMESH_BENCH_THREADS says otherwise.
"""

from __future__ import annotations

import os
import sys
import time

import torch

SHAPES = [(1280, 768), (768, 768), (4096, 768), (768, 2048)]
LAYERS = 12


def main() -> None:
    from kvmesh.kernels.linear import PackedLinear, small_rows_dtype

    dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
    rows = [int(r) for r in (sys.argv[2] if len(sys.argv) > 2 else "1,4,8,16,32,48,64,128,1024").split(",")]
    torch.set_num_threads(int(os.environ.get("KVMESH_BENCH_THREADS", "2")))
    if not small_rows_dtype(dtype, torch.device("cpu")):
        sys.exit(f"no few-rows kernel for {dtype} on this CPU (it needs AVX2 or AVX-512; AVX512-BF16 for bfloat16)")
    g = torch.Generator().manual_seed(0)
    layers = [[PackedLinear((torch.randn(n, k, generator=g) * k**-0.5).to(dtype), small_rows=True) for n, k in SHAPES]
              for _ in range(LAYERS)]
    for layer in layers:
        for product in layer:
            product.add_onednn_copy()  # where the kernel's layout is the only one (AVX2 builds)
    weight_bytes = LAYERS * sum(n * k for n, k in SHAPES) * torch.empty((), dtype=dtype).element_size()
    print(f"{dtype}, {torch.get_num_threads()} threads, {LAYERS} layers of the benchmark model's shapes in turn "
          f"({weight_bytes / 1e6:.0f} MB of weights)")
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in (768, 2048)}
        flops = LAYERS * sum(2 * m * n * k for n, k in SHAPES)
        line = f"rows {m:5d}:"
        for name, limit in (("oneDNN", 0), ("few-rows", 1 << 30)):
            for layer in layers:
                for product in layer:
                    product.small_limit = limit

            def one_pass():
                for layer in layers:
                    for (n, k), product in zip(SHAPES, layer):
                        product(xs[k])

            for _ in range(2):
                one_pass()
            times = []
            for _ in range(7):
                started = time.perf_counter()
                one_pass()
                times.append(time.perf_counter() - started)
            t = sorted(times)[1]
            line += f"  {name} {t * 1e3:7.2f} ms ({flops / t / 1e9:4.0f} GFLOP/s, {weight_bytes / t / 1e9:4.1f} GB/s)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
