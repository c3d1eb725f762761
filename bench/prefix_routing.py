"""KV-aware routing across schedulers: the router's scheduler choice by kvcache's prefix index,
against round-robin over the same schedulers, and against one scheduler owning every worker.

Workload (issue 16): 8 system prompts of 1,024 tokens, 256 requests (each a system prompt plus its
own question of 16..48 tokens, 32 output tokens), sent by 16 concurrent clients to 4 workers (one
torch thread each). Each worker's KV holds about two system prompts beside its running requests,
so where a prompt is sent decides whether its prefix is cached or recomputed. Each configuration
gets a fresh mesh.

    cd bench && ../.venv/bin/python prefix_routing.py
    cd bench && ../.venv/bin/python prefix_routing.py --dtype bfloat16 --kv-memory-mib 48   # the same ~4,000 tokens

Prints, per configuration, time to first token (p50, p90), output tokens/s and the share of prompt
tokens served from the prefix cache; then kv routing's output and TTFT p50 over each other
configuration's, run by run and of the medians (`--repeats N` runs every configuration N
times in turn: at 16 clients one run's ratio to round-robin has spread from 1.71x to 2.18x on one
machine, so a claim rests on several).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from prefix_cache import drive, workload

CONFIGS = {  # name -> (schedulers, router arguments)
    "kv routing, 2 schedulers x 2 workers": (2, []),
    "round-robin, 2 schedulers x 2 workers": (2, ["--scheduler-choice", "round-robin"]),
    "one scheduler x 4 workers": (1, []),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint folder (default: the bench-125m llama)")
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--kv-memory-mib", type=int, default=96, help="KV memory per worker (96 MiB: ~4,000 tokens of bench-125m)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="runs of every configuration, in turn; then kv routing's ratios by run and of the medians")
    ap.add_argument("--dtype", default="", help="the workers' --dtype (default: the checkpoint's, float32)")
    ap.add_argument("--configs", default=";".join(CONFIGS), help="semicolon-separated subset of: " + "; ".join(CONFIGS))
    args = ap.parse_args()
    from kvmesh.modelgen import bench_model_dir
    from kvmesh.services.launcher import free_port, launch, stop, wait_split
    from kvmesh.services.worker.checkpoint import load_config

    model_dir = args.model or str(bench_model_dir())
    prompts = workload(args.num_prefixes, args.prefix_len, args.num_requests, load_config(model_dir).vocab_size, args.seed)
    names = args.configs.split(";")
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in names}  # (TTFT p50 ms, output tok/s)
    for run in range(args.repeats):
        for name in names:
            schedulers, router_args = CONFIGS[name]
            port = free_port()
            children, redis_proc, redis_url = launch(
                model_dir, 4, None, port, schedulers=schedulers, extra_router=router_args,
                extra_worker=["--threads", "1", "--kv-memory-mib", str(args.kv_memory_mib),
                              *(["--dtype", args.dtype] if args.dtype else [])])
            try:
                wait_split(redis_url, children, 120)
                ttfts, tps, cached = asyncio.run(drive(f"127.0.0.1:{port}", prompts, args.output_len, args.concurrency))
            finally:
                stop(children, redis_proc)
            q = statistics.quantiles(ttfts, n=10)
            runs[name].append((statistics.median(ttfts), tps))
            label = f"{name} (run {run + 1})" if args.repeats > 1 else name
            print(f"{label:<46} TTFT p50 {statistics.median(ttfts):8.0f} ms  p90 {q[8]:8.0f} ms  "
                  f"output {tps:6.1f} tok/s  cached {100 * cached:4.1f}% of prompt tokens", flush=True)
    kv = next(iter(CONFIGS))
    if kv in runs:
        for other in names[1:] if names[0] == kv else []:
            print(ratios(kv, other, runs[kv], runs[other]), flush=True)


def ratios(name: str, other: str, mine: list[tuple[float, float]], theirs: list[tuple[float, float]]) -> str:
    """kv routing's output and TTFT p50 over another configuration's, run by run (each pair ran
    one after the other) and of the medians: output over 1 and TTFT under 1 are kv routing's gains."""
    out = [m[1] / t[1] for m, t in zip(mine, theirs)]
    ttft = [m[0] / t[0] for m, t in zip(mine, theirs)]
    median = (statistics.median(m[1] for m in mine) / statistics.median(t[1] for t in theirs),
              statistics.median(m[0] for m in mine) / statistics.median(t[0] for t in theirs))
    return (f"{name.split(',')[0]} / {other.split(',')[0]}: output {median[0]:.2f}x, TTFT p50 {median[1]:.2f}x "
            f"(medians of {len(mine)}; by run: output {', '.join(f'{r:.2f}x' for r in out)}; "
            f"TTFT p50 {', '.join(f'{r:.2f}x' for r in ttft)})")


if __name__ == "__main__":
    main()
