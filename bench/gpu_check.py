"""The GPU figures of issue 18: kvmesh's engine on a ~1B Llama-shaped random checkpoint.

- output tok/s with 64 and with 256 concurrent sequences (continuous batching, inputs 16-512,
  outputs 16-256 tokens, four times as many requests as sequences so the batch stays full);
- single-stream decode tok/s, and that as a fraction of the HBM roofline (a decode step reads
  every weight once: roofline tok/s = HBM bandwidth / bytes of weights).

    python bench/gpu_check.py                               # on a GPU: llama-1b, bfloat16
    python bench/gpu_check.py --device cpu --size tiny      # the script itself, anywhere

bench/gpu_check.sh runs the GPU tests first and then this.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import workload  # noqa: E402

H200_HBM_BYTES_PER_S = 4.8e12


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def throughput(engine, vocab: int, concurrency: int, seed: int) -> dict:
    from kvmesh.params import SamplingParams, StoppingParams

    prompts, outputs = workload(4 * concurrency, (16, 512), (16, 256), vocab, seed)
    engine.scheduler.seq_limit = concurrency
    stops = [StoppingParams(max_new_tokens=o, ignore_eos=True) for o in outputs]
    synchronize(engine.model.device)
    started = time.perf_counter()
    done = engine.generate(prompts, SamplingParams(temperature=0), stops)
    synchronize(engine.model.device)
    elapsed = time.perf_counter() - started
    tokens = sum(len(c.token_ids) for c in done)
    return {"concurrency": concurrency, "requests": len(prompts), "output_tokens": tokens, "elapsed_s": elapsed,
            "output_tok_per_s": tokens / elapsed, "preemptions": sum(c.num_preemptions for c in done)}


def single_stream(engine, vocab: int, new_tokens: int) -> dict:
    """Decode tok/s of one sequence: the time from its first token to its last."""
    from kvmesh.params import SamplingParams, StoppingParams

    req = engine.add_request([(13 * i + 5) % vocab for i in range(128)], SamplingParams(temperature=0),
                             StoppingParams(max_new_tokens=new_tokens, ignore_eos=True))
    first = None
    while engine.has_unfinished():
        engine.step()
        if first is None and req.output_token_ids:
            first = time.perf_counter()
    decoded = len(req.output_token_ids) - 1
    return {"decode_tokens": decoded, "decode_tok_per_s": decoded / (time.perf_counter() - first)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="llama-1b", help="a kvmesh.modelgen size (default llama-1b)")
    ap.add_argument("--model", type=Path, help="a checkpoint folder instead of a generated one")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-memory-gib", type=float, default=40.0)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--concurrency", default="64,256")
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--hbm-bytes-per-s", type=float, default=H200_HBM_BYTES_PER_S)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from kvmesh.engine import EngineConfig, LLMEngine
    from kvmesh.modelgen import SIZES, make_model
    from kvmesh.params import SamplingParams, StoppingParams
    from kvmesh.services.scheduler.core import SchedulerConfig

    concurrency = [int(x) for x in args.concurrency.split(",")]
    model_dir = args.model
    if model_dir is None:
        model_dir = Path(tempfile.gettempdir()) / f"kvmesh-{args.size}-{args.dtype}"
        if not (model_dir / "config.json").is_file():
            started = time.perf_counter()
            make_model(model_dir, "llama", dtype=args.dtype, **SIZES[args.size])
            print(f"generated {model_dir} in {time.perf_counter() - started:.0f}s", flush=True)
    engine = LLMEngine(EngineConfig(
        model=model_dir, device=args.device, dtype=args.dtype, kv_memory_bytes=int(args.kv_memory_gib * (1 << 30)),
        enable_prefix_caching=False,
        scheduler=SchedulerConfig(max_batched_tokens=args.max_batched_tokens, max_num_seqs=max(concurrency))))
    model = engine.model
    print(f"{args.size}: {model.weight_bytes() / 1e9:.2f} GB of weights in {args.dtype} on {model.device}; "
          f"{engine.runner.pool.num_pages} KV pages", flush=True)
    engine.generate([[5] * 64] * 8, SamplingParams(temperature=0), StoppingParams(max_new_tokens=8, ignore_eos=True))  # warm-up
    results = {"size": args.size, "device": str(model.device), "dtype": args.dtype,
               "weight_bytes": model.weight_bytes(), "throughput": []}
    vocab = model.cfg.vocab_size
    for c in concurrency:
        r = throughput(engine, vocab, c, seed=c)
        results["throughput"].append(r)
        print(f"concurrency {c:>4}: {r['output_tokens']} output tokens in {r['elapsed_s']:.1f}s = "
              f"{r['output_tok_per_s']:,.0f} output tok/s ({r['preemptions']} preemptions)", flush=True)
    s = single_stream(engine, vocab, args.decode_tokens)
    roofline = args.hbm_bytes_per_s / model.weight_bytes()
    s.update(roofline_tok_per_s=roofline, fraction_of_roofline=s["decode_tok_per_s"] / roofline)
    results["single_stream"] = s
    print(f"single stream: {s['decode_tok_per_s']:,.1f} decode tok/s = {s['fraction_of_roofline']:.1%} of the "
          f"roofline ({roofline:,.0f} tok/s at {args.hbm_bytes_per_s / 1e12:.1f} TB/s)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
