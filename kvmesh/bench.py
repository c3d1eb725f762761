"""`kvmesh bench`: a serving benchmark client that drives a running mesh over gRPC.

Like vLLM's `benchmark_serving.py`: a workload of prompts (random token ids sent as
`prompt_token_ids`) arrives as a Poisson process at `--request-rate` (or all at once), each
request greedy with `ignore_eos`, so every completion is exactly as long as the workload drew.
Measured per request from the moment it is sent: TTFT (to the first response carrying tokens),
ITL (gaps between token-bearing responses), TPOT ((E2E - TTFT) / (tokens - 1)) and E2E.

The report (a table on stdout, and with `--json` a file) has `completed`, `failed`, `errors`
(failed requests by gRPC status code, or `FINISH_<reason>` for a stream that ended in ERROR or
CANCELLED, `FINISH_MISSING` for one that ended without its finish message), `duration_s`,
`request_throughput`, `output_throughput`, `total_input_tokens`, `total_output_tokens`,
`total_cached_prompt_tokens`, `ttft_ms`, `tpot_ms`, `itl_ms`, `e2e_ms` (each `mean`, `p50`,
`p90`, `p99`; null when no request measured it) and `config`. Only completed requests are
measured. `--sweep-rates` runs once per rate, each with its own draw of the workload (so a run
does not hit the previous run's prompts in the prefix cache), writes the reports as a JSON list
and plots latency against output throughput. The exit code is 1 when no request completed, else 0.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

WORKLOADS = ("random", "shared-prefix", "sharegpt-like")
COMPLETED_REASONS = ("LENGTH", "STOP", "EOS")


# --- configuration -------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    addr: str = "127.0.0.1:50051"
    model: str = ""
    workload: str = "random"
    num_requests: int = 100
    input_len: tuple[int, int] = (32, 256)
    output_len: tuple[int, int] = (16, 128)
    request_rates: tuple[float, ...] = (math.inf,)
    max_concurrency: int | None = None
    seed: int = 0
    vocab_size: int = 500
    shared_prefix_len: int = 512
    num_prefixes: int = 8
    timeout_s: float = 600.0


def parse_range(text: str) -> tuple[int, int]:
    """'32:256' -> (32, 256); both ends inclusive, 1 <= A <= B."""
    try:
        low, high = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a range A:B of token counts (example: 32:256)") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= A <= B")
    return low, high


def parse_rate(text: str) -> float:
    """Requests per second, > 0; 'inf' sends every request at once."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a request rate (examples: 4, 0.5, inf)") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 (or inf), got {text!r}")
    return rate


def parse_rates(text: str) -> tuple[float, ...]:
    return tuple(parse_rate(part) for part in text.split(",") if part.strip())


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def add_parser(sub) -> None:
    """Adds `bench` to an argparse subparsers object."""
    p = sub.add_parser("bench", help="measure a running mesh: TTFT, TPOT, ITL, E2E latency and throughput")
    p.add_argument("--addr", default="127.0.0.1:50051", help="router address (default 127.0.0.1:50051)")
    p.add_argument("--model", default="", help="model name (default: the router's default model)")
    p.add_argument("--workload", choices=WORKLOADS, default="random",
                   help="random: uniform lengths; shared-prefix: one of --num-prefixes prefixes of "
                        "--shared-prefix-len tokens, then a unique suffix of --input-len tokens; "
                        "sharegpt-like: log-normal lengths (median the ranges' geometric middle), clipped to the "
                        "ranges")
    p.add_argument("--num-requests", type=_positive_int, default=100)
    p.add_argument("--input-len", type=parse_range, default=(32, 256), metavar="A:B",
                   help="prompt tokens (default 32:256)")
    p.add_argument("--output-len", type=parse_range, default=(16, 128), metavar="A:B",
                   help="output tokens (default 16:128)")
    p.add_argument("--request-rate", type=parse_rate, default=math.inf,
                   help="Poisson arrivals, requests/s (default inf: all at once)")
    p.add_argument("--max-concurrency", type=_positive_int, help="cap on requests in flight (default: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=_positive_int, default=500,
                   help="prompt token ids are drawn below this (default 500: fits every generated model)")
    p.add_argument("--shared-prefix-len", type=_positive_int, default=512)
    p.add_argument("--num-prefixes", type=_positive_int, default=8)
    p.add_argument("--timeout", type=_positive_seconds, default=600.0,
                   help="per-request deadline in seconds (default 600)")
    p.add_argument("--json", help="write the report (a list of reports with --sweep-rates) to this file")
    p.add_argument("--sweep-rates", type=parse_rates, metavar="R1,R2,...",
                   help="run once per request rate (replaces --request-rate) and plot latency against throughput")
    p.add_argument("--plot", default="bench_sweep.png", help="the sweep's PNG (default bench_sweep.png)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        addr=args.addr, model=args.model, workload=args.workload, num_requests=args.num_requests,
        input_len=args.input_len, output_len=args.output_len,
        request_rates=args.sweep_rates or (args.request_rate,), max_concurrency=args.max_concurrency,
        seed=args.seed, vocab_size=args.vocab_size, shared_prefix_len=args.shared_prefix_len,
        num_prefixes=args.num_prefixes, timeout_s=args.timeout)


# --- workload ------------------------------------------------------------------------------------


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def _uniform_lengths(rng: np.random.Generator, bounds: tuple[int, int], n: int) -> np.ndarray:
    return rng.integers(bounds[0], bounds[1], endpoint=True, size=n)


def _lognormal_lengths(rng: np.random.Generator, bounds: tuple[int, int], n: int) -> np.ndarray:
    # Median at the range's geometric middle, +-2 sigma spanning the range: skewed to short, long tail.
    low, high = bounds
    mu, sigma = math.log(math.sqrt(low * high)), math.log(high / low) / 4
    return np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), low, high).astype(int)


def make_workload(cfg: BenchConfig, rng: np.random.Generator) -> list[BenchRequest]:
    """The requests of one run, drawn from `rng`."""
    n = cfg.num_requests
    lengths = _lognormal_lengths if cfg.workload == "sharegpt-like" else _uniform_lengths
    inputs, outputs = lengths(rng, cfg.input_len, n), lengths(rng, cfg.output_len, n)
    prompts = [rng.integers(0, cfg.vocab_size, size=int(k)).tolist() for k in inputs]
    if cfg.workload == "shared-prefix":
        prefixes = [rng.integers(0, cfg.vocab_size, size=cfg.shared_prefix_len).tolist()
                    for _ in range(cfg.num_prefixes)]
        prompts = [prefixes[int(rng.integers(cfg.num_prefixes))] + suffix for suffix in prompts]
    return [BenchRequest(p, int(k)) for p, k in zip(prompts, outputs)]


def arrival_gaps(n: int, rate: float, rng: np.random.Generator) -> list[float]:
    """Seconds to wait before each request after the first: exponential (Poisson arrivals), 0 at inf."""
    if math.isinf(rate):
        return [0.0] * max(n - 1, 0)
    return rng.exponential(1.0 / rate, size=max(n - 1, 0)).tolist()


# --- driving the mesh ----------------------------------------------------------------------------


@dataclass
class Outcome:
    """One request as the client saw it. Times are seconds from the moment it was sent."""

    error: str | None = None  # gRPC code name or FINISH_<reason>; None when it completed
    output_tokens: int = 0
    token_times: list[float] = field(default_factory=list)  # one per response that carried tokens
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0


def _generate_request(cfg: BenchConfig, req: BenchRequest):
    from kvmesh.v1 import generation_pb2 as gen

    return gen.GenerateRequest(
        model=cfg.model, prompt_token_ids=gen.TokenIds(ids=req.prompt_token_ids),
        sampling=gen.SamplingParams(temperature=0.0),
        stopping=gen.StoppingParams(max_new_tokens=req.output_len, ignore_eos=True))


async def send(stub, cfg: BenchConfig, req: BenchRequest) -> Outcome:
    """Streams one request to the end, reconnecting by request_id when the stream breaks
    (kvmesh.client); a gRPC error becomes the outcome's error, never an exception."""
    import grpc

    from kvmesh import client
    from kvmesh.v1 import generation_pb2 as gen

    out, request = Outcome(prompt_tokens=len(req.prompt_token_ids)), _generate_request(cfg, req)
    start, finish = time.perf_counter(), None
    try:
        async for response in client.generate([stub], request, timeout=cfg.timeout_s):
            if response.tokens:
                out.token_times.append(time.perf_counter() - start)
                out.output_tokens += len(response.tokens)
            if response.HasField("finish"):
                finish = response.finish
    except grpc.aio.AioRpcError as e:
        out.error = e.code().name
    out.e2e_s = time.perf_counter() - start
    if out.error is None and finish is None:
        out.error = "FINISH_MISSING"  # the stream ended without its last message
    elif out.error is None:
        reason = gen.FinishReason.Name(finish.reason)
        out.error = None if reason in COMPLETED_REASONS else f"FINISH_{reason}"
        out.cached_prompt_tokens = finish.cached_prompt_tokens
    return out


async def drive(cfg: BenchConfig, workload: list[BenchRequest], rate: float, gaps: list[float],
                progress: bool) -> tuple[list[Outcome], float]:
    """Sends `workload` with the given arrival gaps; returns the outcomes and the run's seconds."""
    from tqdm import tqdm

    from kvmesh.services import tls
    from kvmesh.v1 import generation_pb2_grpc

    gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = tqdm(total=len(workload), file=sys.stderr, disable=not progress, desc=f"rate {rate:g}", unit="req")

    async def one(stub, req):
        if gate is None:
            return await send(stub, cfg, req)
        async with gate:
            return await send(stub, cfg, req)

    async with tls.channel(cfg.addr) as channel:  # the router's public port, plaintext
        stub = generation_pb2_grpc.GenerationStub(channel)
        start, due, tasks = time.perf_counter(), 0.0, []
        for i, req in enumerate(workload):
            if i:  # against the run's clock, so time spent launching does not pile up as drift
                due += gaps[i - 1]
                await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
            tasks.append(asyncio.create_task(one(stub, req)))
            tasks[-1].add_done_callback(lambda _: bar.update(1))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(outcomes), duration


# --- statistics (pure) ---------------------------------------------------------------------------


def summarize_ms(seconds: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 of `seconds`, in milliseconds (linear-interpolated percentiles); None when empty."""
    if not seconds:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = np.asarray(seconds, dtype=float) * 1000.0
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"mean": float(ms.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def ttft_s(o: Outcome) -> float | None:
    return o.token_times[0] if o.token_times else None


def tpot_s(o: Outcome) -> float | None:
    """Mean time per output token after the first; None for a request with fewer than 2 tokens."""
    if o.output_tokens < 2 or not o.token_times:
        return None
    return (o.e2e_s - o.token_times[0]) / (o.output_tokens - 1)


def itl_gaps(token_times: list[float]) -> list[float]:
    """Gaps between consecutive token-bearing responses."""
    return [b - a for a, b in zip(token_times, token_times[1:])]


def report(outcomes: list[Outcome], duration_s: float) -> dict:
    """The benchmark's figures over completed requests; failed ones are only counted, by error."""
    done = [o for o in outcomes if o.error is None]
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.error is not None:
            errors[o.error] = errors.get(o.error, 0) + 1
    output_tokens = sum(o.output_tokens for o in done)
    per_second = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    return {
        "completed": len(done), "failed": len(outcomes) - len(done), "errors": errors,
        "duration_s": duration_s,
        "request_throughput": per_second(len(done)), "output_throughput": per_second(output_tokens),
        "total_input_tokens": sum(o.prompt_tokens for o in done), "total_output_tokens": output_tokens,
        "total_cached_prompt_tokens": sum(o.cached_prompt_tokens for o in done),
        "ttft_ms": summarize_ms([t for o in done if (t := ttft_s(o)) is not None]),
        "tpot_ms": summarize_ms([t for o in done if (t := tpot_s(o)) is not None]),
        "itl_ms": summarize_ms([g for o in done for g in itl_gaps(o.token_times)]),
        "e2e_ms": summarize_ms([o.e2e_s for o in done]),
    }


# --- output --------------------------------------------------------------------------------------


def format_report(r: dict) -> str:
    rate = _rate_text(r["config"]["request_rate"])
    lines = [f"{' kvmesh bench: rate ' + rate + ' req/s ':=^62}",
             f"{'completed / failed':<34}{r['completed']:>14} / {r['failed']}"]
    lines += [f"{'  ' + code:<34}{n:>14}" for code, n in sorted(r["errors"].items())]
    lines += [f"{'duration (s)':<34}{r['duration_s']:>14.2f}",
              f"{'request throughput (req/s)':<34}{r['request_throughput']:>14.2f}",
              f"{'output throughput (tok/s)':<34}{r['output_throughput']:>14.2f}",
              f"{'output / input / cached tokens':<34}{r['total_output_tokens']:>14} / "
              f"{r['total_input_tokens']} / {r['total_cached_prompt_tokens']}",
              f"{'(ms)':<12}{'mean':>12}{'p50':>12}{'p90':>12}{'p99':>12}"]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        cells = "".join("{:>12}".format("-" if v is None else f"{v:.2f}") for v in r[name].values())
        lines.append(f"{name[:-3].upper():<12}{cells}")
    return "\n".join(lines)


def plot_sweep(reports: list[dict], path: str) -> None:
    """Latency (TTFT p50/p99, E2E p50) against output tok/s, one line per metric, points labeled by rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    lines = (("ttft_ms", "p50", "TTFT p50"), ("ttft_ms", "p99", "TTFT p99"), ("e2e_ms", "p50", "E2E p50"))
    for metric, stat, label in lines:
        points = [(r["output_throughput"], r[metric][stat], r["config"]["request_rate"])
                  for r in reports if r[metric][stat] is not None]
        ax.plot([x for x, _, _ in points], [y for _, y, _ in points], marker="o", label=label)
        for x, y, rate in points:
            ax.annotate(_rate_text(rate), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("output throughput (tok/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title("kvmesh bench: latency against throughput (labels: request rate, req/s)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def _rate_label(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def _rate_text(rate: float | str) -> str:
    return rate if isinstance(rate, str) else f"{rate:g}"


def bench_once(cfg: BenchConfig, index: int, rate: float, progress: bool) -> dict:
    """One run at `rate`; each run draws its own workload (seed, index) so later runs of a sweep
    do not find earlier runs' prompts in the prefix cache."""
    rng = np.random.default_rng([cfg.seed, index])
    workload = make_workload(cfg, rng)
    outcomes, duration = asyncio.run(drive(cfg, workload, rate, arrival_gaps(len(workload), rate, rng), progress))
    config = asdict(cfg)
    del config["request_rates"]
    config.update(request_rate=_rate_label(rate), input_len=list(cfg.input_len), output_len=list(cfg.output_len))
    return {**report(outcomes, duration), "config": config}


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if args.sweep_rates:
        if importlib.util.find_spec("matplotlib") is None:  # checked before the runs, not after them
            print("kvmesh bench: --sweep-rates draws its plot with matplotlib: pip install 'kvmesh[bench]'", file=sys.stderr)
            return 2
    reports = []
    for i, rate in enumerate(cfg.request_rates):
        reports.append(bench_once(cfg, i, rate, progress=not args.no_progress))
        print(format_report(reports[-1]), flush=True)
    if args.sweep_rates:
        plot_sweep(reports, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(reports if args.sweep_rates else reports[0], f, indent=2, allow_nan=False)
    return 0 if any(r["completed"] for r in reports) else 1
