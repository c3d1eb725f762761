"""What the mesh costs: the same workload through `kvmesh up` (gRPC, Redis, separate processes)
and through the in-process engine, both on one worker with the same settings.

    python bench/mesh_overhead.py                 # bench-125m, 32 concurrent streams
    python bench/mesh_overhead.py --model DIR --concurrency 32 --output-len 128
    python bench/mesh_overhead.py --scheduler-arg=--overlap-steps --scheduler-arg=on   # or off, auto
    python bench/mesh_overhead.py --concurrency 1 --dtype bfloat16   # one stream, bfloat16 weights
    python bench/mesh_overhead.py --router-arg=--stream-interval --router-arg=4   # 4 tokens a message

Alternates a mesh pass and an in-process pass (after one warm-up pass of each) and prints
the medians, their ratio, the scheduler's per-step time split (scheduling, wire round trip,
worker forward, applying results) read from Redis, and each process's CPU time per output token
over the measured mesh passes (this script's own is the client's: the engine is idle then). On a
machine the mesh shares with its worker, the others' CPU is what slows the worker's steps
(docs/benchmarks.md, "where the mesh's share of a step goes").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import grpc
import psutil

from kvmesh.services.redis_client import connect
from offline_throughput import workload


async def drive_mesh(addr: str, prompts, output_len: int) -> tuple[float, int]:
    """One pass: every prompt as a concurrent greedy stream; returns (seconds, tokens)."""
    from kvmesh.v1 import generation_pb2 as gen
    from kvmesh.v1 import generation_pb2_grpc

    async def one(stub, prompt):
        n = 0
        request = gen.GenerateRequest(prompt_token_ids=gen.TokenIds(ids=prompt), sampling=gen.SamplingParams(temperature=0),
                                      stopping=gen.StoppingParams(max_new_tokens=output_len, ignore_eos=True))
        async for response in stub.Generate(request, timeout=600):
            n += len(response.tokens)
        return n

    async with grpc.aio.insecure_channel(addr) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(stub, p) for p in prompts))
        return time.perf_counter() - started, sum(counts)


def engine_pass(engine, prompts, output_len: int) -> tuple[float, int]:
    from kvmesh.params import SamplingParams, StoppingParams

    stop = StoppingParams(max_new_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    done = engine.generate(prompts, SamplingParams(temperature=0), stop)
    return time.perf_counter() - started, sum(len(c.token_ids) for c in done)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint folder (default: the bench-125m llama)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", default="64:256")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--kv-memory-mib", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="measured passes of each (after one warm-up pass)")
    ap.add_argument("--dtype", default="", help="both sides' model dtype (default: the checkpoint's, float32)")
    ap.add_argument("--scheduler-arg", action="append", default=[], help="passed to the mesh's scheduler (repeat for each word)")
    ap.add_argument("--router-arg", action="append", default=[], help="passed to the mesh's router (repeat for each word)")
    args = ap.parse_args()
    from kvmesh.modelgen import bench_model_dir
    from kvmesh.services.launcher import free_port, launch, stop
    from kvmesh.services.registry import QUEUE_STATE_PATTERN
    from kvmesh.services.worker.checkpoint import load_config

    model_dir = args.model or str(bench_model_dir())
    lo, hi = (int(x) for x in args.input_len.split(":"))
    prompts, _ = workload(args.concurrency, (lo, hi), (1, 1), load_config(model_dir).vocab_size, args.seed)

    from kvmesh.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=model_dir, kv_memory_bytes=args.kv_memory_mib << 20, dtype=args.dtype or None))
    port = free_port()
    dtype = ["--dtype", args.dtype] if args.dtype else []
    children, redis_proc, redis_url = launch(model_dir, 1, None, port, extra_worker=["--kv-memory-mib", str(args.kv_memory_mib), *dtype],
                                          extra_scheduler=args.scheduler_arg, extra_router=args.router_arg)
    mesh_runs, engine_runs = [], []
    processes = {c.name: psutil.Process(c.process.pid) for c in children}
    processes["client (this script)"] = psutil.Process()
    cpu_s = dict.fromkeys(processes, 0.0)
    mesh_tokens = 0
    try:
        # Alternate the two so that this machine's drifting speed hits both alike; pass 0 warms up.
        for i in range(args.repeat + 1):
            before = cpu_times(processes)
            mesh = asyncio.run(drive_mesh(f"127.0.0.1:{port}", prompts, args.output_len))
            if i:
                for name, spent in cpu_times(processes).items():
                    cpu_s[name] += spent - before[name]
                mesh_tokens += mesh[1]
            local = engine_pass(engine, prompts, args.output_len)
            if i:
                mesh_runs.append(mesh[1] / mesh[0])
                engine_runs.append(local[1] / local[0])
                print(f"pass {i}: mesh {mesh_runs[-1]:7.1f} tok/s, in-process {engine_runs[-1]:7.1f} tok/s")
        time.sleep(1.0)  # let the scheduler publish its final step timing
        r = connect(redis_url, aio=False)
        state = [json.loads(r.get(k)) for k in r.scan_iter(QUEUE_STATE_PATTERN)]
    finally:
        stop(children, redis_proc)
    mesh_tps, engine_tps = statistics.median(mesh_runs), statistics.median(engine_runs)
    print(f"median of {args.repeat}: mesh (1 worker) {mesh_tps:7.1f} output tok/s, in-process engine {engine_tps:7.1f} output tok/s")
    print(f"mesh / in-process: {mesh_tps / engine_tps:.1%}")
    for worker_state in (s for d in state for s in d["workers"].values()):
        t = worker_state["step_timing"]
        n = max(1, t["steps"])
        print(f"per step, all passes ({t['steps']} steps): schedule {t['schedule_s'] / n * 1000:.2f} ms, "
              f"wire {t['wire_s'] / n * 1000:.2f} ms, worker forward {t['forward_s'] / n * 1000:.2f} ms, "
              f"apply results {t['update_s'] / n * 1000:.2f} ms")
    print("CPU per output token over the measured mesh passes: "
          + ", ".join(f"{name} {1000 * spent / max(1, mesh_tokens):.3f} ms" for name, spent in cpu_s.items()))


def cpu_times(processes: dict) -> dict[str, float]:
    """Each process's user + system CPU seconds so far (its threads', not its children's)."""
    return {name: sum(p.cpu_times()[:2]) for name, p in processes.items()}


if __name__ == "__main__":
    main()
