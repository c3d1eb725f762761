"""`kvmesh offline`: JSONL in, JSONL out in input order; bad lines get an error and the rest run."""

import json
import subprocess
import sys

import pytest

from kvmesh.engine import EngineConfig, LLMEngine
from kvmesh.modelgen import SIZES, make_model
from kvmesh.params import SamplingParams, StoppingParams
from kvmesh.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny"), "llama", **SIZES["tiny"])


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "kvmesh.cli", *map(str, args)], capture_output=True, text=True, timeout=120)


def test_offline_writes_one_result_per_line_in_order(tiny_model, tmp_path):
    lines = [
        {"prompt": "The quick brown fox", "max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        {"prompt_token_ids": [1, 40, 41, 42], "max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        {"prompt": "", "max_new_tokens": 4},
        {"prompt": "hello", "top_p": 1.5},
        {"prompt": "hello", "max_new_tokens": 0},
        {"prompt": "hello", "temperature": "hot"},
        {"prompt": "hello", "colour": "blue"},
        {"prompt": "café naïve 日本語", "max_new_tokens": 5, "temperature": 0.8, "top_k": 20, "seed": 3, "ignore_eos": True},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(line) for line in lines) + "\n{not json\n")
    out = tmp_path / "out.jsonl"
    proc = run_cli("offline", "--model", tiny_model, "--input", src, "--output", out, "--kv-memory", "64MiB")
    assert proc.returncode == 0, proc.stderr
    assert "requests" in proc.stderr  # the progress bar
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(results) == len(lines) + 1

    tok = Tokenizer.from_dir(tiny_model)
    engine = LLMEngine(EngineConfig(model=tiny_model, num_pages=64))
    [first] = engine.generate([tok.encode("The quick brown fox")], SamplingParams(temperature=0),
                              StoppingParams(max_new_tokens=6, ignore_eos=True))
    assert results[0]["token_ids"] == first.token_ids
    assert results[0]["text"] == tok.decode(first.token_ids)
    assert results[0]["finish_reason"] == "length" and len(results[0]["logprobs"]) == 6
    assert results[0]["usage"]["prompt_tokens"] == len(tok.encode("The quick brown fox"))
    assert results[0]["usage"]["completion_tokens"] == 6
    assert results[1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "cached_prompt_tokens": 0}

    errors = [r.get("error", "") for r in results[2:7]] + [results[8].get("error", "")]
    assert "prompt" in errors[0] and "empty" in errors[0]
    assert "top_p" in errors[1] and "(0, 1]" in errors[1]
    assert "max_new_tokens" in errors[2] and "at least 1" in errors[2]
    assert "temperature" in errors[3] and "number" in errors[3]
    assert "colour" in errors[4] and "not a known field" in errors[4]
    assert "line" in errors[5] and "JSON" in errors[5]
    assert len(results[7]["token_ids"]) == 5  # the line after the bad ones still ran


def test_make_model_writes_a_loadable_checkpoint(tmp_path):
    proc = run_cli("make-model", "--arch", "qwen2", "--size", "tiny", "--out", tmp_path / "m")
    assert proc.returncode == 0, proc.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "m").iterdir()}


def test_unknown_flag_is_an_error(tmp_path):
    proc = run_cli("offline", "--input", "x", "--output", "y", "--bogus", "1")
    assert proc.returncode == 2 and "--bogus" in proc.stderr
