"""Hugging Face checkpoint folders: the model config and memory-mapped safetensors weights.

Reads `config.json` (transformers 4.x and 5.x spellings), `generation_config.json` when present,
and `model.safetensors` or a sharded `model.safetensors.index.json`. Nothing here imports
transformers: the worker must run without it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Checkpoints over this size get a progress bar while their tensors are read.
PROGRESS_BAR_BYTES = 512 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint folder that kvmesh cannot serve; the message names what is wrong."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    scaling_type: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the runtime needs, normalised across Llama, Mistral and Qwen2."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    sliding_window: int | None
    torch_dtype: str
    eos_token_ids: tuple[int, ...] = field(default=())
    bos_token_id: int | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers, in the checkpoint's dtype."""
        itemsize = torch.empty((), dtype=DTYPES[self.torch_dtype]).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_config(raw: dict) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; 4.x writes `rope_theta` and `rope_scaling`.
    params = dict(raw.get("rope_parameters") or {})
    if not params:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "llama3"):
        raise CheckpointError(f"rope scaling type {rope_type!r} is not supported (supported: default, llama3)")
    if rope_type == "default":
        return RopeConfig(theta=float(params.get("rope_theta", 10000.0)))
    return RopeConfig(
        theta=float(params.get("rope_theta", 10000.0)),
        scaling_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    """Reads `config.json` (and `generation_config.json`) into a ModelConfig."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir} has no config.json: not a Hugging Face checkpoint folder")
    raw = json.loads(path.read_text())
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(
            f"architecture {archs or raw.get('model_type')!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    head_dim = raw.get("head_dim") or hidden // num_heads
    eos = _as_id_tuple(raw.get("eos_token_id"))
    bos = raw.get("bos_token_id")
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        gen = json.loads(gen_path.read_text())
        eos = _as_id_tuple(gen.get("eos_token_id")) or eos
        bos = gen.get("bos_token_id", bos)
    sliding_window = raw.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        sliding_window = None
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not supported (supported: {', '.join(DTYPES)})")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope_config(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
        o_bias=arch != "Qwen2ForCausalLM" and bool(raw.get("attention_bias", False)),
        sliding_window=int(sliding_window) if sliding_window else None,
        torch_dtype=dtype,
        eos_token_ids=eos,
        bos_token_id=bos,
    )


class WeightFiles:
    """Memory-mapped access to a checkpoint's tensors by name, single file or sharded."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        single = model_dir / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: model_dir / fname for name, fname in weight_map.items()}
        elif single.is_file():
            with safe_open(single, "pt") as f:
                self._file_of = {name: single for name in f.keys()}
        else:
            raise CheckpointError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")
        self._handles: dict[Path, object] = {}
        self.total_bytes = sum(p.stat().st_size for p in set(self._file_of.values()))

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, "pt")
        return self._handles[path].get_tensor(name)


def load_weights(model_dir: str | Path, names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Loads the named tensors (mmapped, cast to `dtype`); a missing one is a CheckpointError naming it."""
    files = WeightFiles(model_dir)
    missing = [n for n in names if n not in files]
    if missing:
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    bar = tqdm(names, desc="loading weights", unit="tensor", disable=files.total_bytes < PROGRESS_BAR_BYTES)
    return {name: files.get(name).to(dtype) for name in bar}


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, including llama3 scaling, computed as transformers does (float32)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if cfg.rope.scaling_type != "llama3":
        return inv_freq
    r = cfg.rope
    low_freq_wavelen = r.original_max_position_embeddings / r.low_freq_factor
    high_freq_wavelen = r.original_max_position_embeddings / r.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / r.factor, inv_freq)
    smooth = (r.original_max_position_embeddings / wavelen - r.low_freq_factor) / (
        r.high_freq_factor - r.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
