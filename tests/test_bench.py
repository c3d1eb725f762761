"""`kvmesh bench` against a real mesh: the report's shape and figures, the sweep plot, failures counted."""

import argparse
import json

import numpy as np
import pytest

from kvmesh import bench
from kvmesh.modelgen import SIZES, make_model
from kvmesh.services.launcher import free_port, launch, stop

SMALL = ["--num-requests", "12", "--input-len", "8:32", "--output-len", "4:12", "--no-progress"]
METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def run_bench(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh")
    bench.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


@pytest.fixture(scope="module")
def mesh_addr(tmp_path_factory):
    model_dir = make_model(tmp_path_factory.mktemp("bench-model"), "llama", **SIZES["tiny"])
    port = free_port()
    children, redis, _ = launch(str(model_dir), 1, None, port)
    yield f"127.0.0.1:{port}"
    stop(children, redis)


def assert_sane(report, completed=12):
    assert report["completed"] == completed and report["failed"] == 0 and report["errors"] == {}
    assert report["output_throughput"] > 0 and report["request_throughput"] > 0 and report["duration_s"] > 0
    for name in METRICS:
        stats = report[name]
        assert set(stats) == {"mean", "p50", "p90", "p99"}, name
        assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"], (name, stats)
    assert report["ttft_ms"]["p50"] <= report["e2e_ms"]["p99"]


@pytest.mark.parametrize("rate", ["inf", "50"])
def test_bench_reports_every_figure_for_a_small_workload(mesh_addr, tmp_path, rate):
    out = tmp_path / "report.json"
    assert run_bench("--addr", mesh_addr, *SMALL, "--request-rate", rate, "--json", str(out)) == 0
    report = json.loads(out.read_text())
    assert_sane(report)
    # ignore_eos and max_new_tokens: every request produced exactly the output length it drew.
    cfg = bench.BenchConfig(num_requests=12, input_len=(8, 32), output_len=(4, 12))
    drawn = bench.make_workload(cfg, np.random.default_rng([0, 0]))  # --seed 0, first run
    assert report["total_output_tokens"] == sum(r.output_len for r in drawn)
    assert report["total_input_tokens"] == sum(len(r.prompt_token_ids) for r in drawn)
    assert report["config"]["request_rate"] == (rate if rate == "inf" else 50.0)


def test_concurrency_cap_and_shared_prefix_workload_complete(mesh_addr, tmp_path):
    out = tmp_path / "report.json"
    argv = ["--workload", "shared-prefix", "--shared-prefix-len", "32", "--num-prefixes", "2", "--max-concurrency", "3"]
    assert run_bench("--addr", mesh_addr, *SMALL, *argv, "--json", str(out)) == 0
    report = json.loads(out.read_text())
    assert_sane(report)
    assert report["total_cached_prompt_tokens"] > 0  # later requests found their prefix in the cache


def test_sweep_writes_one_report_per_rate_and_a_png(mesh_addr, tmp_path):
    out, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    argv = ["--sweep-rates", "20,inf", "--json", str(out), "--plot", str(plot)]
    assert run_bench("--addr", mesh_addr, *SMALL, *argv) == 0
    reports = json.loads(out.read_text())
    assert [r["config"]["request_rate"] for r in reports] == [20.0, "inf"]
    for r in reports:
        assert_sane(r)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_against_nothing_listening_counts_every_request_as_unavailable(tmp_path):
    out = tmp_path / "report.json"
    argv = ["--addr", f"127.0.0.1:{free_port()}", *SMALL, "--timeout", "5", "--json", str(out)]
    assert run_bench(*argv) == 1
    report = json.loads(out.read_text())
    assert report["completed"] == 0 and report["failed"] == 12
    assert report["errors"] == {"UNAVAILABLE": 12}
    assert report["output_throughput"] == 0 and report["ttft_ms"]["p50"] is None


@pytest.mark.parametrize("bad", [["--input-len", "10:5"], ["--input-len", "x"], ["--request-rate", "0"],
                                 ["--sweep-rates", "5,-1"], ["--timeout", "0"]])
def test_bad_flags_are_usage_errors(bad):
    with pytest.raises(SystemExit) as e:
        run_bench(*bad)
    assert e.value.code == 2


# --- pure helpers ---------------------------------------------------------------------------------


def test_summarize_ms_gives_mean_and_interpolated_percentiles_in_ms():
    stats = bench.summarize_ms([0.001, 0.002, 0.003, 0.004, 0.010])
    assert stats["mean"] == pytest.approx(4.0)
    assert stats["p50"] == pytest.approx(3.0)
    assert stats["p90"] == pytest.approx(7.6)   # 4 + 0.6 * (10 - 4)
    assert stats["p99"] == pytest.approx(9.76)  # 4 + 0.96 * (10 - 4)
    assert bench.summarize_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_ttft_tpot_and_itl_of_one_request():
    # Responses with tokens at 0.1 s (1 token), 0.3 s (2 tokens), 0.4 s (1 token); stream ended at 0.5 s.
    o = bench.Outcome(output_tokens=4, token_times=[0.1, 0.3, 0.4], e2e_s=0.5)
    assert bench.ttft_s(o) == 0.1
    assert bench.tpot_s(o) == pytest.approx((0.5 - 0.1) / 3)
    assert bench.itl_gaps(o.token_times) == pytest.approx([0.2, 0.1])
    assert bench.tpot_s(bench.Outcome(output_tokens=1, token_times=[0.1], e2e_s=0.2)) is None


def test_report_counts_failures_by_code_and_measures_only_completed_requests():
    outcomes = [bench.Outcome(output_tokens=3, token_times=[0.1, 0.2, 0.3], e2e_s=0.3),
                bench.Outcome(output_tokens=2, token_times=[0.2, 0.4], e2e_s=0.5),
                bench.Outcome(error="UNAVAILABLE"),
                bench.Outcome(error="FINISH_ERROR", output_tokens=1, token_times=[9.0])]
    r = bench.report(outcomes, duration_s=2.0)
    assert (r["completed"], r["failed"], r["errors"]) == (2, 2, {"UNAVAILABLE": 1, "FINISH_ERROR": 1})
    assert r["request_throughput"] == 1.0 and r["output_throughput"] == 2.5
    assert r["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert r["tpot_ms"]["mean"] == pytest.approx((100.0 + 300.0) / 2)  # (0.3-0.1)/2 and (0.5-0.2)/1
    assert r["itl_ms"]["mean"] == pytest.approx((100.0 + 100.0 + 200.0) / 3)
    assert r["e2e_ms"]["p50"] == pytest.approx(400.0)


@pytest.mark.parametrize("workload", bench.WORKLOADS)
def test_workloads_draw_lengths_within_the_ranges(workload):
    cfg = bench.BenchConfig(workload=workload, num_requests=200, input_len=(8, 64), output_len=(4, 32),
                            vocab_size=100, shared_prefix_len=16, num_prefixes=3)
    requests = bench.make_workload(cfg, np.random.default_rng(0))
    prefix = cfg.shared_prefix_len if workload == "shared-prefix" else 0
    assert len(requests) == 200
    assert all(8 + prefix <= len(r.prompt_token_ids) <= 64 + prefix for r in requests)
    assert all(4 <= r.output_len <= 32 for r in requests)
    assert all(0 <= t < 100 for r in requests for t in r.prompt_token_ids)
    if workload == "shared-prefix":
        assert len({tuple(r.prompt_token_ids[:16]) for r in requests}) == 3


def test_poisson_gaps_average_one_over_the_rate_and_are_zero_at_inf():
    gaps = bench.arrival_gaps(20001, 50.0, np.random.default_rng(0))
    assert len(gaps) == 20000 and np.mean(gaps) == pytest.approx(1 / 50, rel=0.05)
    assert bench.arrival_gaps(5, float("inf"), np.random.default_rng(0)) == [0.0] * 4
