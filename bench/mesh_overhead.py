"""What the mesh costs: the same workload through `kvmesh up` (gRPC, Redis, separate processes)
and through the in-process engine, both on one worker with the same settings.

    python bench/mesh_overhead.py                 # bench-125m, 32 concurrent streams
    python bench/mesh_overhead.py --model DIR --concurrency 32 --output-len 128

Prints output tokens/s for both, their ratio, and the scheduler's per-step time split
(scheduling, wire round trip, worker forward, applying results) read from Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import grpc
import redis

from offline_throughput import workload


async def drive_mesh(addr: str, prompts, output_len: int) -> tuple[float, int]:
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
        await asyncio.gather(*(one(stub, p) for p in prompts))  # warm-up: one whole pass
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(stub, p) for p in prompts))
        return time.perf_counter() - started, sum(counts)


def run_engine(model_dir, prompts, output_len: int, kv_mib: int) -> tuple[float, int]:
    from kvmesh.engine import EngineConfig, LLMEngine
    from kvmesh.params import SamplingParams, StoppingParams

    engine = LLMEngine(EngineConfig(model=model_dir, kv_memory_bytes=kv_mib << 20))
    stop = StoppingParams(max_new_tokens=output_len, ignore_eos=True)
    engine.generate(prompts, SamplingParams(temperature=0), stop)  # warm-up: one whole pass
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
    args = ap.parse_args()
    from kvmesh.modelgen import bench_model_dir
    from kvmesh.services.launcher import free_port, launch, stop
    from kvmesh.services.registry import QUEUE_STATE_PATTERN
    from kvmesh.services.worker.checkpoint import load_config

    model_dir = args.model or str(bench_model_dir())
    lo, hi = (int(x) for x in args.input_len.split(":"))
    prompts, _ = workload(args.concurrency, (lo, hi), (1, 1), load_config(model_dir).vocab_size, args.seed)

    port = free_port()
    children, redis_proc, redis_url = launch(model_dir, 1, None, port, extra_worker=["--kv-memory-mib", str(args.kv_memory_mib)])
    try:
        mesh_s, mesh_tokens = asyncio.run(drive_mesh(f"127.0.0.1:{port}", prompts, args.output_len))
        time.sleep(1.0)  # let the scheduler publish its final step timing
        r = redis.Redis.from_url(redis_url, decode_responses=True)
        state = [json.loads(r.get(k)) for k in r.scan_iter(QUEUE_STATE_PATTERN)]
    finally:
        stop(children, redis_proc)
    engine_s, engine_tokens = run_engine(model_dir, prompts, args.output_len, args.kv_memory_mib)
    mesh_tps, engine_tps = mesh_tokens / mesh_s, engine_tokens / engine_s
    print(f"mesh (1 worker)     {mesh_tokens} tokens in {mesh_s:6.1f}s  {mesh_tps:7.1f} output tok/s")
    print(f"in-process engine   {engine_tokens} tokens in {engine_s:6.1f}s  {engine_tps:7.1f} output tok/s")
    print(f"mesh / in-process: {mesh_tps / engine_tps:.1%}")
    for worker_state in (s for d in state for s in d.values()):
        t = worker_state["step_timing"]
        n = max(1, t["steps"])
        print(f"per step ({t['steps']} steps): schedule {t['schedule_s'] / n * 1000:.2f} ms, "
              f"wire {t['wire_s'] / n * 1000:.2f} ms, worker forward {t['forward_s'] / n * 1000:.2f} ms, "
              f"apply results {t['update_s'] / n * 1000:.2f} ms")


if __name__ == "__main__":
    main()
