"""Generated checkpoints load in transformers exactly, and generation is reproducible."""

import json
import threading

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from kvmesh.modelgen import SIZES, default_model_dir, make_model, model_config, num_parameters
from kvmesh.tokenizer import Tokenizer

ARCHS = ("llama", "mistral", "qwen2")


@pytest.mark.parametrize("arch", ARCHS)
def test_model_loads_in_transformers_with_no_missing_or_unexpected_keys(tmp_path, arch):
    make_model(tmp_path, arch, **SIZES["tiny"])

    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)

    assert type(model).__name__ == json.loads((tmp_path / "config.json").read_text())["architectures"][0]
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]


def test_tied_model_has_no_lm_head_and_loads_tied(tmp_path):
    make_model(tmp_path, "llama", tie_word_embeddings=True, **SIZES["tiny"])

    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)

    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_qwen2_checkpoint_has_random_qkv_biases(tmp_path):
    make_model(tmp_path, "qwen2", **SIZES["tiny"])

    weights = load_file(tmp_path / "model.safetensors")

    for proj in ("q_proj", "k_proj", "v_proj"):
        bias = weights[f"model.layers.0.self_attn.{proj}.bias"]
        assert bias.abs().sum() > 0
    assert "model.layers.0.self_attn.o_proj.bias" not in weights


@pytest.mark.parametrize("arch", ARCHS)
def test_config_is_what_transformers_writes_for_it(tmp_path, arch):
    make_model(tmp_path, arch, **SIZES["tiny"])
    resaved = tmp_path / "resaved"

    AutoConfig.from_pretrained(tmp_path).save_pretrained(resaved)

    ours = json.loads((tmp_path / "config.json").read_text())
    theirs = json.loads((resaved / "config.json").read_text())
    theirs.pop("transformers_version")
    assert ours == theirs


def test_weights_follow_the_requested_init_and_dtype(tmp_path):
    make_model(tmp_path, "llama", dtype="bfloat16", **SIZES["small"])

    weights = load_file(tmp_path / "model.safetensors")

    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16}
    assert torch.equal(weights["model.norm.weight"], torch.ones(256, dtype=torch.bfloat16))
    std = weights["model.embed_tokens.weight"].float().std().item()
    assert 0.019 < std < 0.021


def test_same_seed_gives_byte_identical_files_and_another_seed_other_weights(tmp_path):
    first = make_model(tmp_path / "first", "qwen2", seed=7, **SIZES["tiny"])
    second = make_model(tmp_path / "second", "qwen2", seed=7, **SIZES["tiny"])
    other = make_model(tmp_path / "other", "qwen2", seed=8, **SIZES["tiny"])

    names = sorted(path.name for path in first.iterdir())
    assert names == sorted(path.name for path in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_tokenizer_never_outgrows_the_model_vocabulary(tmp_path, size):
    make_model(tmp_path, "llama", **SIZES[size])

    vocab_size = SIZES[size]["vocab_size"]
    assert Tokenizer.from_dir(tmp_path).vocab_size <= vocab_size
    assert len(AutoTokenizer.from_pretrained(tmp_path)) <= vocab_size


def test_generation_stops_on_eos_and_on_the_chat_end_token(tmp_path):
    make_model(tmp_path, "llama", **SIZES["tiny"])

    generation = GenerationConfig.from_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)

    assert generation.bos_token_id == tokenizer.bos_token_id == 1
    assert sorted(generation.eos_token_id) == sorted(tokenizer.convert_tokens_to_ids(["</s>", "<|im_end|>"]))


def test_bench_125m_preset_has_124_7m_parameters(tmp_path):
    assert num_parameters(model_config("llama", **SIZES["bench-125m"])) == 124_668_672


def test_parameter_count_matches_the_written_checkpoint(tmp_path):
    make_model(tmp_path, "qwen2", **SIZES["tiny"])

    written = sum(tensor.numel() for tensor in load_file(tmp_path / "model.safetensors").values())

    assert written == num_parameters(model_config("qwen2", **SIZES["tiny"]))


@pytest.mark.parametrize(
    "arch, overrides, message",
    [
        ("gpt2", {}, "arch must be one of"),
        ("llama", {"num_heads": 3}, "multiple of num_heads"),
        ("llama", {"num_kv_heads": 3}, "multiple of num_kv_heads"),
        ("llama", {"vocab_size": 100}, "vocab_size must be at least"),
        ("llama", {"dtype": "int8"}, "dtype must be one of"),
    ],
)
def test_impossible_shapes_are_rejected_with_the_rule_broken(tmp_path, arch, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_model(tmp_path, arch, **{**SIZES["tiny"], **overrides})


def test_default_model_is_created_once_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_CACHE", str(tmp_path))

    first = default_model_dir()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    second = default_model_dir()

    assert first == second == tmp_path / "models" / "default-v1"
    assert (second / "model.safetensors").stat().st_mtime_ns == stamp
    assert json.loads((first / "config.json").read_text())["hidden_size"] == SIZES["small"]["hidden_size"]
    assert [path.name for path in (tmp_path / "models").iterdir()] == ["default-v1"]


def test_racing_builders_of_the_default_model_all_get_one_complete_copy(tmp_path, monkeypatch):
    # Threads stand in for processes: the guard is the file system's atomic rename either way.
    monkeypatch.setenv("KVMESH_CACHE", str(tmp_path))
    start = threading.Barrier(3)
    results = []

    def build():
        start.wait()
        results.append(default_model_dir())

    racers = [threading.Thread(target=build) for _ in range(3)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(timeout=60)

    assert results == [tmp_path / "models" / "default-v1"] * 3
    assert [path.name for path in (tmp_path / "models").iterdir()] == ["default-v1"]
    assert Tokenizer.from_dir(results[0]).encode("hello")[0] == 1
