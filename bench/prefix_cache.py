"""Shared-prefix serving: prefix caching and KV-aware worker choice, on and off.

Workload: 8 system prompts of 1,024 tokens, 64 requests (each a system prompt plus its own
question of 16..48 tokens, 32 output tokens), sent by 8 concurrent clients to a mesh of two
workers (one torch thread each: two cores). Each configuration gets a fresh mesh.

    cd bench && ../.venv/bin/python prefix_cache.py

Prints, per configuration, time to first token (p50, p90) and output tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import grpc

CONFIGS = {
    "caching + kv-aware": ["--prefix-caching", "true", "--worker-choice", "kv"],
    "caching + round-robin": ["--prefix-caching", "true", "--worker-choice", "round-robin"],
    "no caching + round-robin": ["--prefix-caching", "false", "--worker-choice", "round-robin"],
}


def workload(num_prefixes: int, prefix_len: int, num_requests: int, vocab: int, seed: int):
    """Shared system prompts plus 16..48-token suffixes, from `kvmesh bench`'s generator."""
    import numpy as np

    from kvmesh.bench import BenchConfig, make_workload

    cfg = BenchConfig(workload="shared-prefix", num_requests=num_requests, input_len=(16, 48), vocab_size=vocab,
                      shared_prefix_len=prefix_len, num_prefixes=num_prefixes)
    return [r.prompt_token_ids for r in make_workload(cfg, np.random.default_rng(seed))]


async def drive(addr: str, prompts, output_len: int, concurrency: int, timeout_s: float = 1800):
    """(TTFTs in ms, output tok/s, cached share of prompt tokens) of the prompts sent by `concurrency` clients."""
    from kvmesh.v1 import generation_pb2 as gen
    from kvmesh.v1 import generation_pb2_grpc

    ttfts, queue = [], list(prompts)
    counts = {"tokens": 0, "prompt": 0, "cached": 0}

    async def client(stub):
        while queue:
            prompt = queue.pop(0)
            request = gen.GenerateRequest(prompt_token_ids=gen.TokenIds(ids=prompt),
                                          sampling=gen.SamplingParams(temperature=0),
                                          stopping=gen.StoppingParams(max_new_tokens=output_len, ignore_eos=True))
            started, first = time.perf_counter(), None
            async for response in stub.Generate(request, timeout=timeout_s):
                if response.tokens and first is None:
                    first = time.perf_counter() - started
                counts["tokens"] += len(response.tokens)
                if response.HasField("finish"):
                    counts["prompt"] += response.finish.prompt_tokens
                    counts["cached"] += response.finish.cached_prompt_tokens
            ttfts.append(first * 1000)

    async with grpc.aio.insecure_channel(addr) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        started = time.perf_counter()
        await asyncio.gather(*(client(stub) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return ttfts, counts["tokens"] / elapsed, counts["cached"] / max(1, counts["prompt"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint folder (default: the bench-125m llama)")
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kv-memory-mib", type=int, default=1024, help="KV memory per worker")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    args = ap.parse_args()
    from kvmesh.modelgen import bench_model_dir
    from kvmesh.services.launcher import free_port, launch, stop
    from kvmesh.services.worker.checkpoint import load_config

    model_dir = args.model or str(bench_model_dir())
    prompts = workload(args.num_prefixes, args.prefix_len, args.num_requests, load_config(model_dir).vocab_size, args.seed)
    for name in args.configs.split(","):
        port = free_port()
        children, redis_proc, _ = launch(model_dir, 2, None, port, extra_worker=["--threads", "1", "--kv-memory-mib", str(args.kv_memory_mib)],
                                         extra_scheduler=CONFIGS[name])
        try:
            ttfts, tps, _ = asyncio.run(drive(f"127.0.0.1:{port}", prompts, args.output_len, args.concurrency))
        finally:
            stop(children, redis_proc)
        q = statistics.quantiles(ttfts, n=10)
        print(f"{name:<26} TTFT p50 {statistics.median(ttfts):8.0f} ms  p90 {q[8]:8.0f} ms  output {tps:6.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
