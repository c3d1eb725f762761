"""Matrix products by rows: the few-rows kernel against oneDNN's, over a model's layers in turn.

    cd bench && ../.venv/bin/python linear_rows.py [DTYPE [ROWS,ROWS,...]]

The benchmark model's shapes (twelve layers of q|k|v 1280x768, o 768x768, gate|up 4096x768, down
768x2048), each layer its own weights, all twelve called in turn as a forward pass does, so each
layer's weights were evicted by the others' (151 MB in bfloat16, 302 MB in float32, past any
cache here). For each row count: milliseconds per pass (the second best of 7 after 2 warm-up
passes, wall time), GFLOP/s and the weights' GB/s, with oneDNN's packed weights
(`PackedLinear` without the copy) and with kvmesh's few-rows kernel (`kernels/csrc/small_linear.cpp`,
which `PackedLinear` takes up to `SMALL_ROWS` rows; here at every row count, to show where the
threshold falls). A half-precision dtype is multiplied as the model multiplies it: in float32 where
this CPU has no fast kernel for it (oneDNN then reads float32 weights, and the few-rows kernel
bfloat16 ones, widened in registers: `kernels.linear.small_rows_layout`). Two torch threads unless
KVMESH_BENCH_THREADS says otherwise.
"""

from __future__ import annotations

import os
import sys
import time

import torch

SHAPES = [(1280, 768), (768, 768), (4096, 768), (768, 2048)]
LAYERS = 12


def main() -> None:
    from kvmesh.kernels.linear import PackedLinear, half_linear_dtype, small_rows_layout

    dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
    rows = [int(r) for r in (sys.argv[2] if len(sys.argv) > 2 else "1,4,8,16,32,48,64,128,1024").split(",")]
    torch.set_num_threads(int(os.environ.get("KVMESH_BENCH_THREADS", "2")))
    cpu = torch.device("cpu")
    # as the model's layers: products in float32 where this CPU has no fast kernel for a half dtype,
    # the few-rows layout then in the dtype as stored where the kernel widens it
    linear_dtype = half_linear_dtype(dtype, cpu, 0)
    layout = small_rows_layout(dtype, linear_dtype, cpu)
    if layout is None:
        sys.exit(f"no few-rows kernel for {dtype} on this CPU (it needs AVX2 or AVX-512)")
    g = torch.Generator().manual_seed(0)
    layers = [[PackedLinear((torch.randn(n, k, generator=g) * k**-0.5).to(dtype), compute_dtype=linear_dtype,
                            small_rows=True) for n, k in SHAPES]
              for _ in range(LAYERS)]
    for layer in layers:
        for product in layer:
            product.add_onednn_copy()  # where the kernel's layout is the only one (AVX2 builds)
    params = LAYERS * sum(n * k for n, k in SHAPES)
    read = {name: params * torch.empty((), dtype=d).element_size() for name, d in (("oneDNN", linear_dtype),
                                                                                   ("few-rows", layout))}
    print(f"{dtype}, {torch.get_num_threads()} threads, {LAYERS} layers of the benchmark model's shapes in turn "
          f"(oneDNN's weights in {linear_dtype}, {read['oneDNN'] / 1e6:.0f} MB; the few-rows kernel's in {layout}, "
          f"{read['few-rows'] / 1e6:.0f} MB)")
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
            line += f"  {name} {t * 1e3:7.2f} ms ({flops / t / 1e9:4.0f} GFLOP/s, {read[name] / t / 1e9:4.1f} GB/s)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
