"""KV pages that move: time to first token of a long shared prefix, recomputed, fetched from a
peer worker, and read back from the worker's host-memory tier (issue 16, part 3).

One scheduler, two workers (one torch thread each), the scheduler alternating workers
(`--worker-choice round-robin`) and fetching whenever pages are held elsewhere (`--kv-fetch
always`), the bench-125m Llama with an 8,192-token context. For each prefix length and repeat:

- recompute: a prefix nobody holds, plus a 16-token question;
- peer: the same prefix with another question, on the other worker: its pages come from the first;
- tier: the prefix pushed out of the first worker's pool by other prompts (into its tier), then
  asked again there: its pages are read back from the tier.

Each request asks for one output token, so TTFT is prefill (or transfer) plus one step.

    cd bench && ../.venv/bin/python kv_transfer.py

Prints the median TTFT per case and length and the speed-ups over recomputing.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from pathlib import Path

import grpc

from kvmesh.v1 import generation_pb2 as gen
from kvmesh.v1 import generation_pb2_grpc


def model_with_context(context: int) -> Path:
    """bench-125m's shape with a longer context, generated once into kvmesh's cache."""
    from kvmesh.modelgen import SIZES, cache_dir, make_model

    folder = cache_dir() / "models" / f"bench-125m-ctx{context}-v1"
    if not (folder / "config.json").is_file():
        make_model(folder, "llama", **{**SIZES["bench-125m"], "max_position_embeddings": context})
    return folder


def ids(n: int, rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(5, vocab) for _ in range(n)]


async def ask(stub, prompt: list[int]) -> gen.Finish:
    request = gen.GenerateRequest(prompt_token_ids=gen.TokenIds(ids=prompt), sampling=gen.SamplingParams(temperature=0.0),
                                  stopping=gen.StoppingParams(max_new_tokens=1, ignore_eos=True))
    finish = None
    async for response in stub.Generate(request, timeout=600):
        if response.HasField("finish"):
            finish = response.finish
    return finish


async def measure(address: str, lengths: list[int], repeats: int, pool_tokens: int, vocab: int, seed: int):
    rng = random.Random(seed)
    results: dict[tuple[str, int], list[float]] = {}
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        filler = lambda: ids(8, rng, vocab)  # noqa: E731
        await ask(stub, filler())  # warm-up
        await ask(stub, filler())
        for length in lengths:
            for _ in range(repeats):
                prefix = ids(length, rng, vocab)
                first = await ask(stub, prefix + ids(16, rng, vocab))
                assert first.cached_prompt_tokens == 0, first
                results.setdefault(("recompute", length), []).append(first.ttft_ms)
                peer = await ask(stub, prefix + ids(16, rng, vocab))  # the scheduler's next turn: the other worker
                assert peer.worker_id != first.worker_id and peer.transfer_source == "peer", peer
                results.setdefault(("peer", length), []).append(peer.ttft_ms)
                # Push the prefix out of the first worker's pool (into its tier) with other prompts.
                # The scheduler alternates workers, so each gets every other one: twice its pool in all.
                pushed, last = 0, peer.worker_id
                while pushed < 2 * pool_tokens:
                    last = (await ask(stub, ids(min(length, 2000), rng, vocab))).worker_id
                    pushed += min(length, 2000)
                if last == first.worker_id:  # the next turn is the other worker's: give it a filler
                    await ask(stub, filler())
                tier = await ask(stub, prefix + ids(16, rng, vocab))
                assert tier.worker_id == first.worker_id and tier.transfer_source == "tier", tier
                results.setdefault(("tier", length), []).append(tier.ttft_ms)
                print(f"  {length} tokens: recompute {first.ttft_ms:.0f} ms, peer {peer.ttft_ms:.0f} ms "
                      f"({peer.transferred_prompt_tokens} tokens), tier {tier.ttft_ms:.0f} ms "
                      f"({tier.transferred_prompt_tokens} tokens)", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-memory-mib", type=int, default=256, help="each worker's pool (256 MiB: ~10,900 tokens)")
    ap.add_argument("--kv-offload-mib", type=int, default=1024, help="each worker's host-memory tier")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from kvmesh.services.launcher import free_port, launch, stop
    from kvmesh.services.worker.checkpoint import load_config

    model_dir = model_with_context(8192)
    cfg = load_config(model_dir)
    pool_tokens = (args.kv_memory_mib << 20) // cfg.kv_bytes_per_token
    port = free_port()
    children, redis_proc, _ = launch(
        str(model_dir), 2, None, port,
        extra_worker=["--threads", "1", "--kv-memory-mib", str(args.kv_memory_mib), "--kv-offload-mib", str(args.kv_offload_mib)],
        extra_scheduler=["--worker-choice", "round-robin", "--kv-fetch", "always"])
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
        results = asyncio.run(measure(f"127.0.0.1:{port}", lengths, args.repeats, pool_tokens, cfg.vocab_size, args.seed))
    finally:
        stop(children, redis_proc)
    print(f"\nTTFT, median of {args.repeats} (bench-125m, float32, one thread per worker):")
    for length in lengths:
        med = {case: statistics.median(results[(case, length)]) for case in ("recompute", "peer", "tier")}
        print(f"  {length:>5}-token prefix: recompute {med['recompute']:7.0f} ms   peer {med['peer']:6.0f} ms "
              f"({med['recompute'] / med['peer']:.1f}x)   tier {med['tier']:6.0f} ms ({med['recompute'] / med['tier']:.1f}x)")


if __name__ == "__main__":
    main()
