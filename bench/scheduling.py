"""Scheduler benchmarks on a fresh one-worker mesh per configuration, measured with `kvmesh bench`.

    cd bench && ../.venv/bin/python scheduling.py batching [random|sharegpt-like [MAX_NUM_SEQS [NUM_REQUESTS [MODES]]]]
    cd bench && ../.venv/bin/python scheduling.py bound [WORKLOAD [MAX_NUM_SEQS [NUM_REQUESTS]]]   # no model
    cd bench && ../.venv/bin/python scheduling.py head-of-line   # short requests' TTFT while long prompts arrive
    cd bench && ../.venv/bin/python scheduling.py sweep          # latency against throughput across request rates

`batching`: 32 requests at once, inputs 16..512, outputs 16..512 (uniform, or log-normal as
in ShareGPT), at most 8 running, the same mesh with --batching continuous, static (finished rows
padded to the batch's end) and static-unpadded. `head-of-line`: short requests (inputs 16..64,
outputs 32, 2 per second) beside long prompts (1,800..2,000 tokens, one per 5 seconds), with
chunked prefill (256 tokens per step, at most 128 for one request) and without (4,096: a whole
long prompt in one step).
`sweep`: the sharegpt-like workload at several rates; writes docs/latency_throughput.png.
BENCH_MODEL=cheap runs the mesh benchmarks on pool_size.py's cheap model (1 KiB of KV per token)
instead of bench-125m, with BENCH_KV_MIB of KV (default 2048). BENCH_ROUTER_ARGS (space-separated)
go to the mesh's router, e.g. BENCH_ROUTER_ARGS="--stream-interval 4".
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path


def bench_args(addr: str, *flags: str) -> argparse.Namespace:
    from kvmesh import bench

    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    vocab = "4096" if os.environ.get("BENCH_MODEL") == "cheap" else "32000"  # the model's vocabulary
    return parser.parse_args(["bench", "--addr", addr, "--no-progress", "--vocab-size", vocab, *flags])


def run_bench(addr: str, *flags: str) -> dict:
    from kvmesh import bench

    args = bench_args(addr, *flags)
    cfg = bench.config_from_args(args)
    return bench.bench_once(cfg, 0, cfg.request_rates[0], progress=False)


def with_mesh(scheduler_flags: list[str], body):
    """A one-worker mesh of the benchmark model (BENCH_MODEL=cheap: pool_size.py's cheap model, about
    1 KiB of KV per token) with BENCH_KV_MIB (default 2048) of KV; `body(address)`'s result."""
    from kvmesh.modelgen import bench_model_dir
    from kvmesh.services.launcher import free_port, launch, stop

    if os.environ.get("BENCH_MODEL") == "cheap":
        from pool_size import cheap_model

        model = cheap_model(Path(os.environ.get("KVMESH_CACHE", Path.home() / ".cache" / "kvmesh")) / "cheap-mistral")
    else:
        model = bench_model_dir()
    port = free_port()
    children, redis_proc, _ = launch(str(model), 1, None, port,
                                     extra_worker=["--kv-memory-mib", os.environ.get("BENCH_KV_MIB", "2048")],
                                     extra_scheduler=scheduler_flags,
                                     extra_router=os.environ.get("BENCH_ROUTER_ARGS", "").split())
    try:
        return body(f"127.0.0.1:{port}")
    finally:
        stop(children, redis_proc)


def line(name: str, r: dict) -> str:
    t, e = r["ttft_ms"], r["e2e_ms"]
    return (f"{name:<28} {r['completed']:>3} done {r['failed']:>2} failed  output {r['output_throughput']:7.1f} tok/s  "
            f"TTFT p50 {t['p50']:8.0f} p99 {t['p99']:8.0f} ms  E2E p50 {e['p50']:8.0f} ms")


def batching(workload: str = "random", max_num_seqs: str = "8", num_requests: str = "32",
             modes: str = "continuous,static,static-unpadded") -> None:
    flags = ["--workload", workload, "--num-requests", num_requests, "--input-len", "16:512", "--output-len", "16:512",
             "--seed", os.environ.get("BENCH_SEED", "1"), "--timeout", "7200"]
    results = {}
    for mode in modes.split(","):
        # The whole workload arrives at once on purpose: no request may time out in the queue, nor
        # give up in the client (a static run of 512 requests keeps the last ones waiting > 600 s).
        results[mode] = with_mesh(["--batching", mode, "--max-num-seqs", max_num_seqs, "--max-queue-wait-s", "0"],
                                  lambda addr: run_bench(addr, *flags))
        print(line(f"{mode} batching", results[mode]), flush=True)
    for static in [m for m in results if m != "continuous"]:
        ratio = results["continuous"]["output_throughput"] / results[static]["output_throughput"]
        print(f"continuous / {static} output tok/s: {ratio:.2f}x")


def bound(workload: str = "random", max_num_seqs: str = "32", num_requests: str = "128") -> None:
    """What the scheduler alone allows: the `batching` workload (same seed, lengths and budget)
    through the real scheduler core with no model, counting steps and tokens computed per mode.
    On a device whose step costs the same for 1 or 32 sequences (memory-bound: a GPU at these
    sizes) throughput follows the step count; on one whose step costs what its tokens cost
    (compute-bound: this CPU at 32 sequences) it follows the tokens computed."""
    import numpy as np

    from kvmesh import bench
    from kvmesh.params import SamplingParams, StoppingParams
    from kvmesh.services.kvcache.pages import PagePool
    from kvmesh.services.scheduler.core import Scheduler, SchedulerConfig
    from kvmesh.services.scheduler.request import Request
    from kvmesh.step import SampledToken, StepResult

    args = bench_args("unused", "--workload", workload, "--num-requests", num_requests, "--input-len", "16:512",
                      "--output-len", "16:512", "--seed", os.environ.get("BENCH_SEED", "1"))
    requests = bench.make_workload(bench.config_from_args(args), np.random.default_rng([args.seed, 0]))
    counts = {}
    for mode in ("continuous", "static", "static-unpadded"):
        core = Scheduler(PagePool(100_000, 16), SchedulerConfig(max_num_seqs=int(max_num_seqs), batching=mode))
        for i, r in enumerate(requests):
            core.add(Request(f"r{i}", r.prompt_token_ids, SamplingParams(temperature=0.0),
                             StoppingParams(max_new_tokens=r.output_len, ignore_eos=True), arrival_time=float(i)))
        known = {f"r{i}": len(r.prompt_token_ids) for i, r in enumerate(requests)}  # tokens each row holds
        computed, steps, tokens = dict.fromkeys(known, 0), 0, 0
        while core.has_unfinished():
            plan = core.schedule()
            sampled = []
            for seq_id in plan.dropped:  # preempted or released: recomputed from its known tokens
                computed[seq_id] = 0
            for new in plan.new:  # a prefix-cache hit starts with some tokens computed
                computed[new.seq_id] = new.num_computed_tokens
            for chunk in plan.scheduled:
                computed[chunk.seq_id] += chunk.num_tokens
                tokens += chunk.num_tokens
                if computed[chunk.seq_id] == known[chunk.seq_id]:  # level with its tokens: samples one
                    known[chunk.seq_id] += 1
                    sampled.append(SampledToken(chunk.seq_id, 1, 0.0))
            core.update(plan, StepResult(sampled))
            steps += 1
        counts[mode] = steps, tokens
        print(f"{mode:<16} {steps:6d} steps  {tokens:8d} tokens computed")
    for static in ("static", "static-unpadded"):
        print(f"continuous / {static}: memory-bound (steps) {counts[static][0] / counts['continuous'][0]:.2f}x, "
              f"compute-bound (tokens) {counts[static][1] / counts['continuous'][1]:.2f}x")


def head_of_line() -> None:
    configs = (("chunked prefill (256, 128 each)", ["--max-batched-tokens", "256", "--max-prefill-chunk", "128"]),
               ("no chunking (4096)", ["--max-batched-tokens", "4096", "--max-prefill-chunk", "0"]))
    for name, scheduler_flags in configs:
        def body(addr):
            out = {}
            longs = threading.Thread(target=lambda: out.setdefault("long", run_bench(
                addr, "--num-requests", "6", "--input-len", "1800:2000", "--output-len", "16:16", "--request-rate", "0.2",
                "--seed", "2")))
            longs.start()
            out["short"] = run_bench(addr, "--num-requests", "60", "--input-len", "16:64", "--output-len", "32:32",
                                     "--request-rate", "2", "--seed", "3")
            longs.join()
            return out

        out = with_mesh(scheduler_flags, body)
        print(line(f"short, {name}", out["short"]), flush=True)
        print(line(f"long, {name}", out["long"]), flush=True)


def sweep() -> None:
    from kvmesh import bench

    plot = Path(__file__).resolve().parent.parent / "docs" / "latency_throughput.png"

    def body(addr):
        args = bench_args(addr, "--workload", "sharegpt-like", "--num-requests", "40", "--input-len", "16:512",
                          "--output-len", "16:256", "--sweep-rates", "0.5,1,2,4,inf", "--plot", str(plot))
        return bench.run(args)

    with_mesh([], body)


def main() -> None:
    which = sys.argv[1] if len(sys.argv) > 1 else ""
    runs = {"batching": batching, "bound": bound, "head-of-line": head_of_line, "sweep": sweep}
    if which not in runs:
        sys.exit(f"usage: scheduling.py {{{'|'.join(runs)}}}; batching takes [WORKLOAD [MAX_NUM_SEQS [NUM_REQUESTS [MODES]]]]")
    runs[which](*sys.argv[2:])


if __name__ == "__main__":
    main()
