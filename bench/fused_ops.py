"""kvmesh's fused elementwise operators against the torch operators they replace.

    cd bench && ../.venv/bin/python fused_ops.py

The benchmark model's shapes (12 query + 4 KV heads of 64 rotated in the fused q|k|v projection,
hidden 768, intermediate 2,048), at 64 rows (a decode step) and 1,024 (a prefill chunk), in
float32 and bfloat16, torch's threads (every core). Prints microseconds per call, torch / fused
(mean of 200-2,000 calls after 5 warm-up calls). float32 RMSNorm is torch's `F.rms_norm` on both
sides (the model keeps it).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def per_call_us(fn, calls: int) -> float:
    for _ in range(5):
        fn()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    from kvmesh.kernels import native

    ops = native.fused_ops()
    if ops is None:
        raise SystemExit("kvmesh's C++ kernels are not built here")
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (64, 1024):
            calls = 2000 if rows == 64 else 200
            qkv = torch.randn(rows, 1280, dtype=dtype)
            qk = qkv[:, :1024].view(rows, 16, 64)
            cos, sin = torch.randn(rows, 64, dtype=dtype), torch.randn(rows, 64, dtype=dtype)
            gate_up = torch.randn(rows, 4096, dtype=dtype)
            x, w = torch.randn(rows, 768, dtype=dtype), torch.randn(768, dtype=dtype)

            def torch_rotary():
                out = qk * cos[:, None]
                out += qk.roll(32, dims=-1) * sin[:, None]
                return out

            def torch_silu_mul():
                gate, up = gate_up.chunk(2, dim=-1)
                return F.silu(gate).mul_(up)

            def torch_rms_norm():
                if dtype == torch.float32:
                    return F.rms_norm(x, (768,), w, 1e-6)
                h = x.float()
                return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)

            fused_rms = (lambda: F.rms_norm(x, (768,), w, 1e-6)) if dtype == torch.float32 else (lambda: ops.rms_norm(x, w, 1e-6))
            print(f"{str(dtype).removeprefix('torch.'):<9} {rows:5} rows  "
                  f"rotary {per_call_us(torch_rotary, calls):7.1f} / {per_call_us(lambda: ops.rotary_(qk, cos, sin), calls):7.1f} us  "
                  f"silu_mul {per_call_us(torch_silu_mul, calls):7.1f} / {per_call_us(lambda: ops.silu_mul(gate_up), calls):7.1f} us  "
                  f"rms_norm {per_call_us(torch_rms_norm, calls):7.1f} / {per_call_us(fused_rms, calls):7.1f} us", flush=True)


if __name__ == "__main__":
    main()
