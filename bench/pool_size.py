"""Does a large KV pool cost more than a small one? `kvmesh offline` with a cheap model, two pool sizes.

    cd bench && ../.venv/bin/python pool_size.py [NUM_REQUESTS [KV_MEMORY ...]]

The model is Mistral-shaped and cheap (hidden 64, 4 layers, 2 KV heads of 16: 1 KiB of KV per
token, so 64 MiB is about 4,000 pages of 16 tokens and 4 GiB about 260,000). The requests are
ShareGPT-like (log-normal lengths, inputs 16..1024, outputs 16..512, seed 0), greedy, EOS ignored,
so every run computes the same tokens. Each run is a `kvmesh offline` process, as a user runs it;
it prints wall time and the process's CPU time (user + system, which a busy machine inflates
less than wall time), and the ratio of each size's time to the first size's.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def cheap_model(folder: Path) -> Path:
    from kvmesh.modelgen import make_model

    if not (folder / "config.json").exists():
        make_model(folder, "mistral", vocab_size=4096, hidden_size=64, intermediate_size=192, num_layers=4,
                   num_heads=4, num_kv_heads=2, max_position_embeddings=2048)
    return folder


def workload(path: Path, n: int) -> None:
    from kvmesh.bench import BenchConfig, make_workload

    cfg = BenchConfig(workload="sharegpt-like", num_requests=n, input_len=(16, 1024), output_len=(16, 512),
                      vocab_size=4096)
    with open(path, "w") as f:
        for r in make_workload(cfg, np.random.default_rng(0)):
            f.write(json.dumps({"prompt_token_ids": r.prompt_token_ids, "max_new_tokens": r.output_len,
                                "temperature": 0.0, "ignore_eos": True}) + "\n")


def run(model: Path, requests: Path, kv_memory: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one `kvmesh offline` run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kvmesh.cli", "offline", "--model", str(model), "--kv-memory", kv_memory,
                    "--input", str(requests), "--output", os.devnull, "--quiet"], check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 384
    sizes = sys.argv[2:] or ["64MiB", "4GiB"]
    work = Path(tempfile.gettempdir()) / "kvmesh-pool-size"
    work.mkdir(exist_ok=True)
    model = cheap_model(work / "model")
    requests = work / f"requests-{n}.jsonl"
    workload(requests, n)
    first = None
    for size in sizes:
        wall, cpu = run(model, requests, size)
        first = first or (wall, cpu)
        print(f"kv {size:>7}: {wall:6.1f} s wall ({wall / first[0]:.2f}x), {cpu:6.1f} s CPU ({cpu / first[1]:.2f}x), "
              f"{n} requests", flush=True)


if __name__ == "__main__":
    main()
