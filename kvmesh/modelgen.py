"""Small random Hugging Face checkpoints, made without transformers.

`make_model` writes a folder that `transformers.AutoModelForCausalLM.from_pretrained`
and `AutoTokenizer.from_pretrained` load as-is: `config.json`, `generation_config.json`,
`model.safetensors` (random weights, transformers' tensor names), and a byte-level BPE
`tokenizer.json` + `tokenizer_config.json` trained on a synthetic corpus. Everything is
deterministic: the same arguments give byte-identical files, so tests and benchmarks on
different machines run the same model.

`default_model_dir()` is the model kvmesh serves when none is given: the "small" preset,
built once into the cache folder.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DTYPES = ("float32", "float16", "bfloat16")  # torch is imported only to write weights: `kvmesh --help` stays fast

# Keyword arguments of `make_model` for each named size.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2, max_position_embeddings=2048),
    "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_layers=4,
                  num_heads=8, num_kv_heads=4, max_position_embeddings=2048),
    # 124,668,672 parameters with untied embeddings (GPT-2-small class), for throughput runs.
    "bench-125m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12,
                       num_heads=12, num_kv_heads=4, max_position_embeddings=2048),
    # 1,100,480,512 parameters: Llama-3.2-1B's layers (hidden 2048, 16 layers, 32 heads over 8 KV
    # heads, MLP 8192) with a 32,000-token vocabulary, for GPU runs (bench/gpu_check.sh).
    "llama-1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_layers=16,
                     num_heads=32, num_kv_heads=8, max_position_embeddings=8192),
}

# Ids 0..4, in this order; the Llama convention (unk=0, bos=1, eos=2) comes first.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
UNK_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
# Byte-level BPE needs all 256 byte symbols plus the special tokens before any merge.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen2's word-splitting pattern, as transformers' Qwen2Tokenizer writes it: digits one by one.
_QWEN2_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

DEFAULT_MODEL_NAME = "default-v1"
INIT_STD = 0.02


def make_model(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    *,
    vocab_size: int = 4096,
    hidden_size: int = 256,
    intermediate_size: int = 688,
    num_layers: int = 4,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
    seed: int = 0,
    rope_theta: float = 10000.0,
) -> Path:
    """Write a random `arch` checkpoint with its tokenizer into `out_dir` and return its path.

    `out_dir` is created if missing; files already in it are overwritten. Weights are
    normal(0, 0.02) (norm weights 1) drawn from a torch.Generator seeded with `seed`.
    Raises ValueError for an unknown arch or dtype, or a shape that cannot work (heads not
    dividing the hidden size, kv heads not dividing heads, odd head_dim, vocab too small).
    """
    config = model_config(
        arch, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        dtype=dtype, rope_theta=rope_theta,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json",
                {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID]})
    from safetensors.torch import save_file

    save_file(random_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    train_tokenizer(vocab_size, arch).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(max_position_embeddings))
    return out


def model_config(
    arch: str,
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    max_position_embeddings: int,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
    rope_theta: float = 10000.0,
) -> dict:
    """The `config.json` dict transformers 5 would save for this shape (plus `architectures`)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE} (256 bytes + special tokens), got {vocab_size}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads})")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    head_dim = hidden_size // num_heads
    if head_dim % 2:
        raise ValueError(f"head_dim (hidden_size / num_heads = {head_dim}) must be even for rotary embeddings")

    config = {
        "architectures": [ARCHITECTURES[arch]],
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "dtype": dtype,
        "eos_token_id": EOS_ID,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": INIT_STD,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "model_type": arch,
        "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": num_kv_heads,
        "pad_token_id": None,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": float(rope_theta), "rope_type": "default"},
        "tie_word_embeddings": tie_word_embeddings,
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif arch == "mistral":
        # transformers defaults to a 4096 window; none keeps attention full, as in our engine.
        config.update(sliding_window=None)
    else:  # qwen2: q/k/v biases are implied by the architecture, not a config key
        config.update(layer_types=["full_attention"] * num_layers, max_window_layers=num_layers,
                      sliding_window=None, use_sliding_window=False)
    return config


def weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of every weight in a checkpoint of `config`, in file order."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    qkv_bias = config["model_type"] == "qwen2"
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        for proj, out_dim in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
            shapes[f"{layer}.self_attn.{proj}.weight"] = (out_dim, hidden)
            if qkv_bias:
                shapes[f"{layer}.self_attn.{proj}.bias"] = (out_dim,)
        shapes[f"{layer}.self_attn.o_proj.weight"] = (hidden, q_dim)
        shapes[f"{layer}.mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{layer}.mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{layer}.mlp.down_proj.weight"] = (hidden, inter)
        shapes[f"{layer}.input_layernorm.weight"] = (hidden,)
        shapes[f"{layer}.post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def num_parameters(config: dict) -> int:
    """Parameter count of a checkpoint of `config` (a tied lm_head is not counted twice)."""
    total = 0
    for shape in weight_shapes(config).values():
        count = 1
        for dim in shape:
            count *= dim
        total += count
    return total


def random_weights(config: dict, seed: int) -> dict:
    """Weights for `config` (name -> torch.Tensor): normal(0, 0.02), norm weights 1, reproducible from `seed`."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, config["dtype"])
    weights = {}
    # Draw in float32 and in weight_shapes' fixed order, so every dtype shares the same values.
    for name, shape in weight_shapes(config).items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape)
        else:
            tensor = torch.empty(shape).normal_(0.0, INIT_STD, generator=generator)
        weights[name] = tensor.to(dtype).contiguous()
    return weights


def train_tokenizer(vocab_size: int, arch: str = "llama") -> Tokenizer:
    """A byte-level BPE tokenizer of at most `vocab_size` ids, trained on `synthetic_corpus`.

    Ids 0..4 are SPECIAL_TOKENS; `encode` prepends `<s>` when add_special_tokens is on.
    llama and mistral split words with GPT-2's rules; qwen2 with Qwen2's (see below).
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    if arch == "qwen2":
        # transformers loads every qwen2 folder as Qwen2Tokenizer, which keeps only the vocab and
        # merges of tokenizer.json and rebuilds these steps; writing the same ones here keeps the
        # ids of transformers and of kvmesh.tokenizer (which reads tokenizer.json as is) equal.
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # About 0.6 sentences per id fills the vocab to vocab_size without wasting time.
    num_sentences = max(3000, vocab_size * 5 // 8)
    tokenizer.train_from_iterator(synthetic_corpus(num_sentences), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return tokenizer


_WORDS = (
    "the of and to in a is that for it as was with be by on not he i this are or his from at "
    "which but have an they you were her she there been one all we their has would when if more "
    "no out so said what up its about into than them can only other new some could time these two "
    "may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year off come "
    "since against go came right used take three model token cache page prefix batch request"
).split()
# Made-up words from these syllables give BPE enough distinct material to fill large vocabularies.
_SYLLABLES = (
    "ka ri to na me lo su vi pe da mo ne ta ro shi ul an er in or en al ar is on at es ed ing ly "
    "ment tion ver pre con de re com pro str gra ble"
).split()
# Multi-byte text, so merges split and join UTF-8 sequences of 2, 3 and 4 bytes.
_NON_ASCII = ("café", "naïve", "résumé", "über", "señor", "日本語", "東京", "中文", "привет",
              "😀", "🚀", "👍🏽", "½", "€", "—")
_END_MARKS = (".", ".", ".", "!", "?", ",", ";", ":")


def synthetic_corpus(num_sentences: int, seed: int = 0):
    """Yield `num_sentences` English-like sentences, the same ones for the same arguments."""
    rng = random.Random(seed)
    for _ in range(num_sentences):
        words = [_corpus_word(rng) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + rng.choice(_END_MARKS)
        if rng.random() < 0.1:
            sentence = f'"{sentence}"'
        if rng.random() < 0.05:
            sentence += "\n"
        yield sentence


def _corpus_word(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.6:
        return rng.choice(_WORDS)
    if roll < 0.95:
        return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
    return rng.choice(_NON_ASCII)


def tokenizer_config(model_max_length: int) -> dict:
    """`tokenizer_config.json` for the trained tokenizer: special tokens and a ChatML template."""
    return {
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "model_max_length": model_max_length,
        # Explicitly none: some tokenizer classes (Qwen2Tokenizer) otherwise invent a pad token.
        "pad_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": SPECIAL_TOKENS[UNK_ID],
    }


def cache_dir() -> Path:
    """Where kvmesh keeps generated models: `$KVMESH_CACHE`, else `~/.cache/kvmesh`."""
    return Path(os.environ.get("KVMESH_CACHE") or Path.home() / ".cache" / "kvmesh")


def default_model_dir() -> Path:
    """The default model (llama, "small" preset, seed 0), built on first use and reused after."""
    return preset_model_dir("small", DEFAULT_MODEL_NAME)


def default_model_exists() -> bool:
    """Whether the default model is already built (its first use will not generate it)."""
    return (cache_dir() / "models" / DEFAULT_MODEL_NAME / "config.json").is_file()


def bench_model_dir() -> Path:
    """The 124.7M-parameter llama the benchmarks run, built on first use and reused after."""
    return preset_model_dir("bench-125m", "bench-125m-v1")


def preset_model_dir(size: str, name: str) -> Path:
    """A llama of preset `size` (seed 0) cached as `models/<name>`, built on first use.

    Safe when several processes start at once: each builds in a private temp folder and
    renames it into place; a loser of the race discards its copy and uses the winner's.
    """
    target = cache_dir() / "models" / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    try:
        make_model(building, "llama", **SIZES[size])
        os.rename(building, target)
    except OSError:
        # rename fails when another process already put a complete model at `target`.
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
