"""The sampler alone: one step's draw for a batch of rows over the benchmark model's vocabulary.

    cd bench && ../.venv/bin/python sampler.py [THREADS]

Random logits of 32,000 tokens per row (standard normal: flat, as a random-weight model's are),
on a thread of its own as the worker's step runs it. Prints milliseconds per call of `sample`
(median of 20 after 3 warm-up calls) at 1, 32 and 128 rows for greedy rows, rows drawn at
temperature 1 (what vLLM's benchmark client asks for: it sends no temperature, and the server's
default is 1), rows drawn with top-p 0.9, and the same on peaked rows (logits times 4: a few
hundred tokens hold 90% of the mass, as in a trained model's rows).
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import torch


def main() -> None:
    from kvmesh.params import SamplingParams
    from kvmesh.services.worker.sampling import SamplingRow, sample

    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    cases = {"greedy": (SamplingParams(temperature=0.0), 1), "temperature 1": (SamplingParams(temperature=1.0), 1),
             "top-p 0.9": (SamplingParams(top_p=0.9), 1), "top-p 0.9 peaked": (SamplingParams(top_p=0.9), 4)}
    for rows in (1, 32, 128):
        flat = torch.randn(rows, 32000, generator=torch.Generator().manual_seed(rows))
        line = f"{rows:4d} rows"
        for name, (params, scale) in cases.items():
            logits = flat * scale
            batch = [SamplingRow(SamplingParams(**{**vars(params), "seed": i}), [1, 2, 3], [4] * i) for i in range(rows)]
            times = []
            for i in range(23):
                started = time.perf_counter()
                sample(logits, batch)
                if i >= 3:
                    times.append(time.perf_counter() - started)
            line += f"  {name} {statistics.median(times) * 1000:7.2f} ms"
        print(line, flush=True)


if __name__ == "__main__":
    thread = threading.Thread(target=main)
    thread.start()
    thread.join()
