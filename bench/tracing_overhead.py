"""What tracing costs: output tokens/s of the same one-worker mesh with tracing off, on (default
sampling: every request, every token step, exported over OTLP/gRPC to a receiver in this process),
and on with the collector down (the endpoint refuses connections).

    cd bench && ../.venv/bin/python tracing_overhead.py [ROUNDS [CONFIGS]]   # CONFIGS: e.g. off,down

The three meshes run side by side (idle while another is measured) and are measured in turns,
ROUNDS times (default 4) after a warm-up run on each, so the machine's drift hits each
configuration alike; the medians are compared.
"""

from __future__ import annotations

import statistics
import sys

from scheduling import run_bench

WORKLOAD = ["--workload", "random", "--num-requests", "48", "--input-len", "16:256", "--output-len", "64:128",
            "--request-rate", "inf"]


def main() -> None:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "tests"))
    from otlp_receiver import Receiver

    from kvmesh.modelgen import bench_model_dir
    from kvmesh.services.launcher import free_port, launch, stop

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    receiver = Receiver()
    otlp = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}", "OTEL_EXPORTER_OTLP_INSECURE": "true"}
    down = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}", "OTEL_EXPORTER_OTLP_INSECURE": "true"}
    configs = {"tracing off": {}, "tracing on": otlp, "collector down": down}
    if len(sys.argv) > 2:  # a subset, by first word: off, on, down
        configs = {name: env for name, env in configs.items() if name.split()[-1] in sys.argv[2].split(",")}
    meshes = {}
    try:
        for name, env in configs.items():
            port = free_port()
            children, redis_proc, _ = launch(str(bench_model_dir()), 1, None, port, env=env,
                                             extra_worker=["--kv-memory-mib", "2048"])
            meshes[name] = (f"127.0.0.1:{port}", children, redis_proc)
        for name in configs:  # warm-up: first requests on a fresh mesh pay one-time costs
            run_bench(meshes[name][0], *WORKLOAD[:2], "--num-requests", "12", *WORKLOAD[4:], "--seed", "99")
        results: dict[str, list[float]] = {name: [] for name in configs}
        for i in range(rounds):
            for name in configs:
                r = run_bench(meshes[name][0], *WORKLOAD, "--seed", str(i))  # new prompts each round: no prefix-cache hits
                results[name].append(r["output_throughput"])
                print(f"round {i + 1} {name:<15} {r['completed']} done {r['failed']} failed  "
                      f"output {r['output_throughput']:6.1f} tok/s  TTFT p50 {r['ttft_ms']['p50']:6.0f} ms  "
                      f"ITL p50 {r['itl_ms']['p50']:5.1f} ms", flush=True)
        base = statistics.median(results["tracing off"])
        for name, values in results.items():
            median = statistics.median(values)
            print(f"{name:<15} median {median:6.1f} tok/s = {median / base * 100:5.1f}% of tracing off")
        print(f"spans received: {len(receiver.spans)}")
    finally:
        for _, children, redis_proc in meshes.values():
            stop(children, redis_proc)
        receiver.server.stop(0)


if __name__ == "__main__":
    main()
