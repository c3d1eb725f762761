"""Decode against llama.cpp on the same checkpoint: one stream and a batch of streams.

    cd bench && ../.venv/bin/python vs_llamacpp.py --llama-bin DIR --gguf PATH [--dtype float32]
                                                   [--batches 1,32] [--rounds 3]

For each batch size B, in alternated rounds: B sequences of a 128-token prompt then 128 greedy
tokens (EOS ignored), decode tokens per second over all B (the prompts' prefill is not timed):
- llama.cpp: `llama-batched-bench -npp 128 -ntg 128 -npl B`, its S_TG column (B x 128 tokens over
  the generation phase's wall time);
- kvmesh: the engine (`LLMEngine`, no mesh) on the checkpoint the GGUF was made from, B requests
  stepped until each has its first token, then timed until all 128 are out.
Both with the same thread count (--threads; default every core). The GGUF must hold the same
weights in the same dtype (`--dtype`): the comparison is of the engines' decode at one model's
shapes, not of their outputs.

Setting up llama.cpp (no binary wheel is published for Linux; its source is in the
llama-cpp-python sdist):

    pip download llama-cpp-python --no-binary :all: --no-deps -d /tmp/llamacpp && cd /tmp/llamacpp
    tar xzf llama_cpp_python-*.tar.gz && cd llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
    cmake --build build -j --target llama-batched-bench      # then --llama-bin build/bin

The benchmark model's checkpoint to GGUF (`convert_hf_to_gguf.py`, beside the source above):
its tokenizer is a byte-level BPE that the converter does not know by hash and its Llama path
tries sentencepiece first, so name the GPT-2 pre-tokenizer and the BPE vocabulary yourself:

    cd llama_cpp_python-*/vendor/llama.cpp && /work/main/.venv/bin/python - <<'EOF'
    import sys; sys.path[:0] = ["gguf-py", "."]
    import convert_hf_to_gguf as c, conversion.base as b, conversion.llama as l
    b.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    l.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
    from kvmesh.modelgen import bench_model_dir
    sys.argv = ["c", str(bench_model_dir()), "--outtype", "f32", "--outfile", "/tmp/bench-125m-f32.gguf"]
    c.main()
    EOF
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

PROMPT, NEW = 128, 128


def llamacpp_decode(binary: Path, gguf: str, batch: int, threads: int) -> float:
    """llama-batched-bench's generation-phase tok/s over `batch` sequences."""
    cmd = [str(binary), "-m", gguf, "-npp", str(PROMPT), "-ntg", str(NEW), "-npl", str(batch),
           "-c", str(batch * (PROMPT + NEW) + 16), "-t", str(threads), "-tb", str(threads),
           "--output-format", "jsonl"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if len(rows) != 1:
        raise SystemExit(f"llama-batched-bench printed {len(rows)} result rows:\n{out}")
    return float(rows[0]["speed_tg"])


def kvmesh_decode(engine, batch: int, seed: int) -> float:
    """The engine's decode tok/s over `batch` sequences, from the step after every first token."""
    from kvmesh.params import SamplingParams, StoppingParams

    prompts = [[1000 + (seed * 7 + b * 131 + i) % 30000 for i in range(PROMPT)] for b in range(batch)]
    reqs = [engine.add_request(p, SamplingParams(temperature=0), StoppingParams(max_new_tokens=NEW, ignore_eos=True))
            for p in prompts]
    while not all(r.output_token_ids for r in reqs):
        engine.step()
    before = sum(len(r.output_token_ids) for r in reqs)
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - started
    return (sum(len(r.output_token_ids) for r in reqs) - before) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-bin", type=Path, required=True, help="folder with llama-batched-bench")
    ap.add_argument("--gguf", required=True, help="the checkpoint as GGUF, in --dtype")
    ap.add_argument("--model", default=None, help="the checkpoint folder (default: bench-125m)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()

    import torch

    from kvmesh.engine import EngineConfig, LLMEngine
    from kvmesh.modelgen import bench_model_dir

    torch.set_num_threads(args.threads)
    binary = args.llama_bin / "llama-batched-bench"
    batches = [int(b) for b in args.batches.split(",")]
    engine = LLMEngine(EngineConfig(model=args.model or str(bench_model_dir()), dtype=args.dtype,
                                    kv_memory_bytes=1 << 30, enable_prefix_caching=False))
    kvmesh_decode(engine, max(batches), seed=-1)  # warm-up: every step shape the rounds take
    rates: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for batch in batches:
            rates.setdefault(("llama.cpp", batch), []).append(llamacpp_decode(binary, args.gguf, batch, args.threads))
            rates.setdefault(("kvmesh", batch), []).append(kvmesh_decode(engine, batch, seed=r))
    print(f"{args.dtype}, {PROMPT}-token prompts then {NEW} greedy tokens, decode tok/s over all sequences, "
          f"{args.threads} threads, {args.rounds} alternated rounds:")
    for batch in batches:
        ours, theirs = rates[("kvmesh", batch)], rates[("llama.cpp", batch)]
        print(f"  batch {batch:>3}  kvmesh    " + "  ".join(f"{v:7.1f}" for v in ours))
        print(f"  batch {batch:>3}  llama.cpp " + "  ".join(f"{v:7.1f}" for v in theirs)
              + f"   kvmesh / llama.cpp {statistics.median(ours) / statistics.median(theirs):.2f}x (medians)")


if __name__ == "__main__":
    main()
