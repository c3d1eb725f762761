"""Single-stream decode: one sequence's tokens per second, with and without the few-rows kernel.

    cd bench && ../.venv/bin/python single_stream.py [DTYPE [ROUNDS [NEW_TOKENS [STREAMS]]]]

The engine (`LLMEngine`, no mesh) on the benchmark model, a 128-token prompt, NEW_TOKENS greedy
tokens (default 128, EOS ignored). Each round times one generation three ways, alternated in one
process so all see the same machine: as the model runs by default where the CPU has the few-rows
kernel (`kernels/csrc/small_linear.cpp`; a decode step's layers in one C++ call,
`kernels/csrc/decode_layers.cpp`), with the same kernels called one by one from Python (the model's
`decode_layers` off), and with every product in oneDNN (each layer's `small_limit` set to 0).
STREAMS (default 1) sequences of distinct prompts decode side by side; the rate is over all of
them. Torch's default threads (every core).
"""

from __future__ import annotations

import sys
import time


def main() -> None:
    from kvmesh.engine import EngineConfig, LLMEngine
    from kvmesh.modelgen import bench_model_dir
    from kvmesh.params import SamplingParams, StoppingParams

    dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    new_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    streams = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    engine = LLMEngine(EngineConfig(model=str(bench_model_dir()), dtype=dtype, kv_memory_bytes=1 << 30))
    model = engine.runner.model
    products = [model.lm_head] + [p for layer in model.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    limits = [p.small_limit for p in products]
    for product in products:
        product.add_onednn_copy()  # where the kernel's layout is the only one (AVX2 builds)
    if not any(limits):
        sys.exit(f"the model keeps no few-rows copy here ({dtype}): nothing to compare")
    one_call = model.decode_layers
    prompts = [list(range(1000 + 128 * s, 1128 + 128 * s)) for s in range(streams)]
    greedy = SamplingParams(temperature=0)
    engine.generate(prompts, greedy, StoppingParams(max_new_tokens=8, ignore_eos=True))  # warm-up
    ways = [("few-rows", True, one_call), ("per operator", True, None), ("oneDNN only", False, None)]
    if one_call is None:
        ways.pop(1)
    rates: dict[str, list[float]] = {name: [] for name, _, _ in ways}
    for _ in range(rounds):
        for name, on, layers in ways:
            for product, limit in zip(products, limits):
                product.small_limit = limit if on else 0
            model.decode_layers = layers
            started = time.perf_counter()
            engine.generate(prompts, greedy, StoppingParams(max_new_tokens=new_tokens, ignore_eos=True))
            rates[name].append(streams * new_tokens / (time.perf_counter() - started))
    model.decode_layers = one_call
    what = "one stream" if streams == 1 else f"{streams} streams"
    print(f"{dtype}, {what}, {new_tokens} tokens after a 128-token prompt, {rounds} alternated rounds (tok/s):")
    for name, values in rates.items():
        print(f"  {name:<12} " + "  ".join(f"{v:6.1f}" for v in values))


if __name__ == "__main__":
    main()
