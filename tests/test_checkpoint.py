"""Loading Hugging Face checkpoint folders: variants that must work and errors that must be clear."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvmesh.engine import EngineConfig, LLMEngine
from kvmesh.kernels.linear import native_half_products, small_rows_layout, small_rows_only, small_rows_widens
from kvmesh.params import SamplingParams, StoppingParams
from kvmesh.services.worker.checkpoint import CheckpointError, load_config
from kvmesh.services.worker.model import CausalLM
from reference import assert_matches_reference, hf_greedy, save_hf_checkpoint

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [5, 77, 301, 12, 9, 250, 33, 480, 61, 2, 140, 19]


def greedy_matches(model_dir, n=16):
    [done] = LLMEngine(EngineConfig(model=model_dir, num_pages=32)).generate(
        [PROMPT], GREEDY, StoppingParams(max_new_tokens=n, ignore_eos=True))
    return assert_matches_reference(done.token_ids, done.logprobs, hf_greedy(model_dir, PROMPT, n))


def test_sharded_checkpoint_loads_through_its_index(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert greedy_matches(tmp_path) > 0


def test_tied_embeddings_and_llama3_rope_scaling_match_transformers(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model_dir = save_hf_checkpoint("llama", tmp_path, tie_word_embeddings=True, rope_parameters=rope)
    cfg = load_config(model_dir)
    assert cfg.tie_word_embeddings and cfg.rope.scaling_type == "llama3"
    assert greedy_matches(model_dir) > 0


def test_mistral_head_dim_and_qwen2_bias_are_read(hf_checkpoint):
    assert load_config(hf_checkpoint("qwen2")).qkv_bias
    cfg = load_config(hf_checkpoint("mistral", head_dim=32))
    assert cfg.head_dim == 32
    assert greedy_matches(hf_checkpoint("mistral", head_dim=32)) > 0


def test_unsupported_architecture_is_named(tmp_path, hf_checkpoint):
    src = hf_checkpoint("llama")
    raw = json.loads((src / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel.*not supported"):
        load_config(tmp_path)


def test_missing_tensor_is_named(tmp_path, hf_checkpoint):
    src = hf_checkpoint("llama")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
        CausalLM.load(tmp_path)


def test_folder_without_weights_or_config_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_config(tmp_path)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoints_load_in_their_dtype(tmp_path, dtype):
    from kvmesh.modelgen import SIZES, make_model

    model_dir = make_model(tmp_path, "llama", dtype=dtype, **SIZES["tiny"])
    model = CausalLM.load(model_dir)
    assert str(model.dtype) == f"torch.{dtype}" and model.embed.dtype == model.dtype
    [done] = LLMEngine(EngineConfig(num_pages=16), model=model).generate([PROMPT], GREEDY, StoppingParams(max_new_tokens=4))
    assert len(done.token_ids) >= 1
    # Matrix products in the model's dtype, or in float32 on a CPU with no fast kernel for it (the
    # float32 copies fit: a tiny model); the memory the worker plans for counts them as held, and
    # the second copy of the few-rows kernel where this CPU has it beside oneDNN's (it fits too).
    own = native_half_products(model.dtype)
    assert model.linear_dtype == (model.dtype if own else torch.float32)
    assert model.lm_head.compute_dtype == (None if own else torch.float32)
    cfg = model.cfg
    matrices = (cfg.num_layers * (cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                                  + cfg.num_heads * cfg.head_dim * cfg.hidden_size
                                  + 3 * cfg.hidden_size * cfg.intermediate_size)
                + cfg.vocab_size * cfg.hidden_size)
    table = 0 if own and cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * 2
    # the few-rows layout in the products' dtype, or in the model's bfloat16 where the kernel widens it
    layout = small_rows_layout(model.dtype, model.linear_dtype, model.device)
    assert model.small_rows == (layout is not None) and model.small_layout == layout
    assert layout in (None, model.linear_dtype) or (layout == model.dtype == torch.bfloat16 and not own)
    if model.small_rows:
        assert model.lm_head.small.dtype == layout
    # the tiny model's copies fit: the layout replaces oneDNN's only where it is in the products' dtype
    assert model.small_only == (model.small_rows and small_rows_only() and layout == model.linear_dtype)
    if model.small_rows and not model.small_only and small_rows_only():  # AVX2, bfloat16 widened: the rest in float32
        assert model.lm_head.rest.dtype == torch.float32 and model.lm_head.packed is None
    onednn = 0 if model.small_only else matrices * (2 if own else 4)  # none where the layout replaces oneDNN's
    kernel = matrices * layout.itemsize if model.small_rows else 0
    assert model.weight_bytes() == onednn + kernel + table


def test_a_bfloat16_model_with_no_room_for_float32_copies_multiplies_from_its_own_weights(tmp_path, monkeypatch):
    """On a CPU that multiplies bfloat16 in float32 and whose few-rows kernel widens it (AVX-512
    without AVX512-BF16 or AMX, AVX2), a model whose float32 copies do not fit in half of the memory keeps
    only its bfloat16 weights, in that kernel's layout, which takes every product: the worker plans
    for the checkpoint's bytes, and greedy output is the roomy model's (the same products in
    float32; a prompt's sums in the kernel's order instead of oneDNN's). On a CPU that has such
    kernels the test stands in for one without them: the same code runs either way."""
    from kvmesh.kernels import linear as linear_module
    from kvmesh.modelgen import SIZES, make_model

    if not small_rows_widens(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no few-rows kernel on this CPU (it needs AVX2 or AVX-512)")
    monkeypatch.setattr(linear_module, "native_half_products", lambda dtype: False)
    model_dir = make_model(tmp_path, "llama", dtype="bfloat16", **SIZES["tiny"])
    roomy = CausalLM.load(model_dir)
    monkeypatch.setattr(linear_module, "_memory_available", lambda available: 1 if available is None else available)
    tight = CausalLM.load(model_dir)
    assert roomy.linear_dtype == tight.linear_dtype == torch.float32
    # the roomy model's float32 copy: oneDNN's, or in the AVX2 build the kernel's float32 layout
    assert roomy.small_rows and not roomy.small_only
    assert (roomy.lm_head.rest if small_rows_only() else roomy.lm_head.packed) is not None
    assert tight.small_only and tight.small_layout == torch.bfloat16
    for product in [tight.lm_head] + [p for layer in tight.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]:
        assert product.small.dtype == torch.bfloat16 and product.packed is None and product.weight is None
    cfg = tight.cfg
    matrices = tight._matrix_params()
    table = cfg.vocab_size * cfg.hidden_size * 2
    assert tight.weight_bytes() == matrices * 2 + table
    assert roomy.weight_bytes() == matrices * (4 + 2) + table
    stop = StoppingParams(max_new_tokens=8, ignore_eos=True)
    outputs = [LLMEngine(EngineConfig(num_pages=16), model=m).generate([PROMPT], GREEDY, stop)[0].token_ids
               for m in (roomy, tight)]
    assert len(outputs[0]) == 8 and outputs[0] == outputs[1]
