"""Single-stream decode at long contexts, where each token reads as many bytes of KV cache as of weights.

    cd bench && ../.venv/bin/python long_context.py [DTYPE [CONTEXTS [NEW_TOKENS [ROUNDS]]]]

The benchmark model's layers (124.7M parameters; 12 query heads over 4 KV heads of 64, about 24 KB
of float32 KV a token) with positions up to 16,384, built once into the model cache as
`bench-125m-16k-v1`. The engine (`LLMEngine`, no mesh), torch's default threads: for each prompt
length in CONTEXTS (default 2048,8192,16000) one random prompt, then NEW_TOKENS greedy tokens
(default 64, EOS ignored), ROUNDS times (default 2; the prompt's pages are dropped between rounds,
so every round computes it). Prints the prefill's seconds and the decode's tokens per second, from
the first output token to the last.
"""

from __future__ import annotations

import random
import sys
import time


def long_model_dir():
    from kvmesh.modelgen import SIZES, cache_dir, make_model

    target = cache_dir() / "models" / "bench-125m-16k-v1"
    if not (target / "config.json").is_file():
        make_model(target, "llama", **{**SIZES["bench-125m"], "max_position_embeddings": 16384})
    return target


def main() -> None:
    from kvmesh.engine import EngineConfig, LLMEngine
    from kvmesh.params import SamplingParams, StoppingParams

    dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
    contexts = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "2048,8192,16000").split(",")]
    new_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    engine = LLMEngine(EngineConfig(model=str(long_model_dir()), dtype=dtype, kv_memory_bytes=1 << 30,
                                    enable_prefix_caching=False))
    greedy = SamplingParams(temperature=0)
    rng = random.Random(0)
    engine.generate([[rng.randrange(5, 32000) for _ in range(64)]], greedy,
                    StoppingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    print(f"{dtype}, one stream, {new_tokens} tokens after each prompt, {rounds} rounds")
    for context in contexts:
        for _ in range(rounds):
            prompt = [rng.randrange(5, 32000) for _ in range(context)]
            req = engine.add_request(prompt, greedy, StoppingParams(max_new_tokens=new_tokens + 1, ignore_eos=True))
            started = time.perf_counter()
            first = None
            while engine.has_unfinished():
                engine.step()
                if first is None and req.output_token_ids:
                    first = time.perf_counter()
            done = time.perf_counter()
            print(f"  context {context:6d}: prefill {first - started:6.2f} s, decode {new_tokens / (done - first):6.1f} tok/s",
                  flush=True)


if __name__ == "__main__":
    main()
