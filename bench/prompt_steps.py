"""Prompt tokens by step budget: the same prompts computed in steps of each token budget, alternated.

    cd bench && ../.venv/bin/python prompt_steps.py [DTYPE [BUDGETS [PROMPT_LEN [ROUNDS]]]]

One `LLMEngine` per budget (default 1024,4096) on the benchmark model, all in this process. Each
round gives every engine, in turn (the order alternating round by round), as many prompts of
PROMPT_LEN tokens (default 1,000) as the largest budget holds, each asking one token, and times
them to their end: the smallest budget computes them in several steps, the largest in one. Prints
the median time per budget and the median of each round's ratio to the first budget's time, which
a machine whose speed moves while it runs (a shared host) disturbs less than two separate runs.
"""

from __future__ import annotations

import random
import statistics
import sys
import time


def main() -> None:
    from kvmesh.engine import EngineConfig, LLMEngine
    from kvmesh.modelgen import bench_model_dir
    from kvmesh.params import SamplingParams, StoppingParams
    from kvmesh.services.scheduler.core import SchedulerConfig

    dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
    budgets = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1024,4096").split(",")]
    prompt_len = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 16
    per_round = max(1, max(budgets) // prompt_len)
    engines = {b: LLMEngine(EngineConfig(model=str(bench_model_dir()), dtype=dtype, kv_memory_bytes=1 << 30,
                                         enable_prefix_caching=False,
                                         scheduler=SchedulerConfig(max_batched_tokens=b, max_num_seqs=128)))
               for b in budgets}
    rng = random.Random(0)
    times: dict[int, list[float]] = {b: [] for b in budgets}
    for i in range(rounds + 1):  # the first round warms every engine up and is not counted
        for b in budgets if i % 2 == 0 else budgets[::-1]:
            engine = engines[b]
            for _ in range(per_round):
                prompt = [rng.randrange(3, engine.model.cfg.vocab_size) for _ in range(prompt_len)]
                engine.add_request(prompt, SamplingParams(temperature=0), StoppingParams(max_new_tokens=1, ignore_eos=True))
            started = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            if i:
                times[b].append(time.perf_counter() - started)
    first = budgets[0]
    print(f"{dtype}, {per_round} prompts of {prompt_len} tokens a round, {rounds} rounds")
    for b in budgets:
        ratios = [t / t0 for t, t0 in zip(times[b], times[first])]
        print(f"  {b:6d}-token steps: {statistics.median(times[b]) * 1e3:8.1f} ms a round "
              f"({per_round * prompt_len / statistics.median(times[b]):7.0f} prompt tokens/s); "
              f"by round {statistics.median(ratios):.3f}x the {first}-token steps' time "
              f"(range {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
