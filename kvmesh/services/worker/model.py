"""The decoder-only transformer (Llama, Mistral, Qwen2) over a flattened batch and a paged KV cache.

The math follows transformers' implementation step for step (RMSNorm in float32, rotary
embeddings from a float32 table, softmax attention, SiLU-gated MLP) so greedy tokens match it.
Projections are fused at load time (q|k|v and gate|up) so one step runs few, large matrix
products; logits are computed only for the rows that are sampled. A half-precision model on a CPU
without a fast kernel for its dtype (none in oneDNN, or bfloat16 without AVX512-BF16 or AMX)
multiplies in float32 (`kernels.linear.half_linear_dtype`). On an AVX-512 or AVX2 CPU the
matrices are also kept in the layout of kvmesh's few-rows kernel, which takes decode steps' products
(`kernels.linear.small_rows_limit`) at the memory's speed where oneDNN's read the weights more slowly
(from bfloat16 as stored where a bfloat16 model multiplies in float32:
`kernels.linear.small_rows_layout`).

On the CPU, a step of more rows than fit the last-level cache runs each layer's MLP in blocks of
rows (`mlp_block_rows`): the gate|up product's output of a 2,048-token float32 step of the
benchmark model is 32 MiB, the whole L3 of a Zen 4's two cores, and its MLP took 8% longer per row
than in 1,024-row blocks (10% at 4,096 rows), which made big prompt steps cost more per token
than small ones (docs/benchmarks.md).

On the CPU, a layer's elementwise steps (RMSNorm, the rotary embedding, SiLU(gate) * up) are
kvmesh's fused C++ operators (`kernels/csrc/fused_ops.cpp`), one pass each where torch runs three
to eight operators, rounding where transformers' operators round (RMSNorm sums a row in another
order: its result may be a unit of the last place off; in float32 torch's `F.rms_norm` took
0.15-1.7 ms for 512 rows of 768 from run to run, the fused operator 0.08).

On the CPU, a step of decodes alone whose products the few-rows kernel takes (one sequence's
step, or a batch's between prompts) runs its layers in one C++ call, `decode_layers`
(kernels/csrc/decode_layers.cpp): the operators of the loop in `forward`, in its order and with its
arguments, so the logits are the same bit for bit, without Python between them (most of the 3 ms
of a 19-20 ms one-sequence float32 step outside its products on an AVX2 Zen 3; the products too
ran slower for the pauses).

Weights, rotary tables and the KV cache live on the model's device. Attention is planned once
per step for that device (`kernels.attention.plan_attention`): kvmesh's C++ decode and prefill
kernels on the CPU, its Triton kernels on CUDA, torch's attention where neither applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from kvmesh.kernels import native
from kvmesh.kernels.attention import AttentionPlan, SequenceSlice, plan_attention, write_kv
from kvmesh.kernels.linear import (
    PackedLinear,
    half_linear_dtype,
    onednn_rows,
    small_rows_layout,
    small_rows_plan,
)
from kvmesh.services.worker.checkpoint import DTYPES, ModelConfig, load_config, load_weights, rope_inv_freq


@dataclass
class LayerWeights:
    qkv: PackedLinear
    o: PackedLinear
    gate_up: PackedLinear
    down: PackedLinear
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor


@dataclass
class BatchInput:
    """One step's flattened batch: every token to run, its position, the slot its KV goes to,
    each sequence's slice, and which rows need logits (the last row of each sampled sequence)."""

    token_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slots: torch.Tensor  # [T] long
    seqs: list[SequenceSlice]
    logit_rows: torch.Tensor  # [S] long
    kv_rows: torch.Tensor | None = None  # rows whose K and V are written (None: all); others are in the cache already
    page_size: int = 16  # the KV pool's: slot = page * page_size + offset

    def to(self, device: torch.device) -> "BatchInput":
        """The batch with its tensors on `device` (the slices stay on the host: attention plans from them)."""
        if device.type == "cpu":
            return self
        move = lambda t: None if t is None else t.pin_memory().to(device, non_blocking=True)  # noqa: E731
        return BatchInput(move(self.token_ids), move(self.positions), move(self.slots), self.seqs,
                          move(self.logit_rows), move(self.kv_rows), self.page_size)


def _tensor_names(cfg: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if cfg.qkv_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if cfg.o_bias:
            names.append(p + "self_attn.o_proj.bias")
    return names


class CausalLM:
    """A loaded checkpoint. `forward(batch, k_cache, v_cache)` returns float32 logits for
    `batch.logit_rows`, after writing the batch's K and V into the cache."""

    folder: Path | None = None  # the checkpoint folder it was loaded from (its tokenizer.json serves grammars)
    # Attention kernels: "auto" (native C++ on the CPU, Triton on CUDA), "triton" (also on the CPU,
    # through Triton's interpreter: tests), or "torch" (torch's attention per sequence).
    attention_backend: str = "auto"

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        w = {name: t.to(self.device) for name, t in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        # the dtype of the matrix products: the model's, or float32 on a CPU with no fast kernel for its dtype
        self.linear_dtype = half_linear_dtype(dtype, self.device, self._matrix_params() * _itemsize(dtype))
        # the matrices in the few-rows kernel's layout where it runs: a second copy for decode steps
        # where it fits (AVX-512), the only one where that kernel takes every product (AVX2); in the
        # model's bfloat16 where its products run in float32 (the kernel widens it: half the bytes),
        # beside a float32 copy for the rest (oneDNN's; AVX2: the kernel's float32 layout), and where
        # no float32 copy fits beside it, that layout takes every product (`small_only`)
        self.small_layout = small_rows_layout(dtype, self.linear_dtype, self.device)
        params = self._matrix_params()
        plan = small_rows_plan(self.small_layout, self.linear_dtype, params * _itemsize(self.linear_dtype),
                               params * _itemsize(self.small_layout) if self.small_layout else 0)
        self.small_rows, self.small_only = plan != "none", plan == "only"
        self.lm_head = self._linear(self.embed if cfg.tie_word_embeddings else w["lm_head.weight"])
        self.layers = [self._layer(w, i) for i in range(cfg.num_layers)]
        # kvmesh's fused RMSNorm, rotary and SiLU-mul on the CPU (torch's operators elsewhere);
        # found or compiled now, at load, rather than in the first request
        self.fused = native.fused_ops() if self.device.type == "cpu" else None
        self.mlp_rows = mlp_block_rows(cfg.intermediate_size, _itemsize(dtype), self.device)
        # A decode step's layers in one C++ call where every product has the few-rows layout
        # (`_layers_in_one_call` says which steps): their tensors listed once, as it takes them.
        self.decode_layers = None
        self._layer_products = [p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if self.fused is not None and all(p.small is not None for p in self._layer_products):
            self.decode_layers = native.decode_layers()
            self._layer_tensors = [t for layer in self.layers for t in (
                layer.qkv.small, layer.o.small, layer.gate_up.small, layer.down.small, layer.input_norm,
                layer.post_attention_norm)]
            self._layer_biases = [p.bias for p in self._layer_products]
        self.scale = cfg.head_dim**-0.5
        positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * rope_inv_freq(cfg)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype).to(self.device)
        # sin with the first half negated: rotate_half(x) * sin == roll(x, half) * signed_sin, bit for bit
        # (a sign flip is exact), in one roll where rotate_half takes two slices, a negation and a cat.
        half = cfg.head_dim // 2
        self.signed_sin = torch.cat((-emb[:, :half].sin(), emb[:, half:].sin()), dim=-1).to(dtype).to(self.device)

    @classmethod
    def load(cls, model_dir: str | Path, dtype: str | None = None, device: torch.device | str = "cpu") -> "CausalLM":
        """Loads a checkpoint folder onto `device`; `dtype` overrides the checkpoint's (float32,
        bfloat16, float16)."""
        cfg = load_config(model_dir)
        dtype = dtype or cfg.torch_dtype
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported (supported: {', '.join(DTYPES)})")
        weights = load_weights(model_dir, _tensor_names(cfg), DTYPES[dtype])
        model = cls(cfg, weights, DTYPES[dtype], device)
        model.folder = Path(model_dir)
        return model

    def _matrix_params(self) -> int:
        """Parameters of the matrix products: every layer's projections and the LM head."""
        cfg = self.cfg
        per_layer = (cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                     + cfg.num_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size)
        return cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size

    def weight_bytes(self) -> int:
        """Bytes of weights the model holds (packed CPU weights count at their dense size): the
        matrices in the dtype they are multiplied in (oneDNN's copy, unless the few-rows kernel's
        layout replaces it) and in the few-rows layout's (`small_layout`), the embedding table in
        the model's; a tied LM head counts once unless it is kept in another dtype than the table."""
        params = self._matrix_params()
        layout = params * _itemsize(self.small_layout) if self.small_rows else 0
        onednn = 0 if self.small_only else params * _itemsize(self.linear_dtype)
        matrices = onednn + layout
        embeddings = self.cfg.vocab_size * self.cfg.hidden_size * _itemsize(self.dtype)
        if self.cfg.tie_word_embeddings and self.linear_dtype == self.dtype:
            return matrices
        return matrices + embeddings

    def _linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear:
        return PackedLinear(weight, bias, compute_dtype=self.linear_dtype, small_rows=self.small_rows,
                            small_only=self.small_only)

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        qkv_bias = None
        if self.cfg.qkv_bias:
            qkv_bias = torch.cat([w[attn + f"{x}_proj.bias"] for x in "qkv"])
        return LayerWeights(
            qkv=self._linear(torch.cat([w[attn + f"{x}_proj.weight"] for x in "qkv"]), qkv_bias),
            o=self._linear(w[attn + "o_proj.weight"], w.get(attn + "o_proj.bias")),
            gate_up=self._linear(torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])),
            down=self._linear(w[p + "mlp.down_proj.weight"]),
            input_norm=w[p + "input_layernorm.weight"],
            post_attention_norm=w[p + "post_attention_layernorm.weight"],
        )

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:  # transformers' six (float32) or eight (half precision) operators in one pass
            return self.fused.rms_norm(x, weight, self.cfg.rms_norm_eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.cfg.rms_norm_eps)
        h = x.float()  # half precision: normalized in float32, rounded, then scaled, as transformers does
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return weight * h.to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding, transformers' `x * cos + rotate_half(x) * sin`."""
        out = x * cos
        out += x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
        return out

    @torch.inference_mode()
    def forward(self, batch: BatchInput, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """k_cache / v_cache: `[layers, slots, kv_heads, head_dim]`. Returns `[len(logit_rows), vocab]` float32."""
        cfg = self.cfg
        t = batch.token_ids.shape[0]
        rows, block = self.step_rows(t)
        token_ids, positions = batch.token_ids, batch.positions
        if rows > t:  # rows of token 0 at position 0 after the step's own: computed, never read
            token_ids, positions = F.pad(token_ids, (0, rows - t)), F.pad(positions, (0, rows - t))
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        cos, sin = self.cos[positions], self.signed_sin[positions]
        fused = self.fused
        heads = cfg.num_heads
        x = self.embed[token_ids]
        attention = plan_attention(batch.seqs, self.device, self.attention_backend, batch.page_size,
                                   cfg.sliding_window)
        kv_rows = batch.kv_rows
        kv_slots = batch.slots if kv_rows is None else batch.slots[kv_rows]
        if self._layers_in_one_call(attention, rows, t, block, kv_rows, kv_slots):
            x = self.decode_layers(x, self._layer_tensors, self._layer_biases, cos, sin, k_cache, v_cache, kv_slots.contiguous(),
                                   attention.rows, attention.indptr, attention.slot_ids, heads, cfg.num_kv_heads,
                                   cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps, self.scale,
                                   self.layers[0].qkv.compute_dtype)
        else:
            for i, layer in enumerate(self.layers):
                h = self._rms_norm(x, layer.input_norm)
                qkv = layer.qkv(h)
                # q and k rotated together: they are adjacent in the fused projection
                qk = qkv[:, : q_size + kv_size].view(rows, heads + cfg.num_kv_heads, cfg.head_dim)
                if fused is not None:
                    fused.rotary_(qk, cos, sin)
                else:
                    qk = self._rotate(qk, cos.unsqueeze(1), sin.unsqueeze(1))
                q, k = qk[:, :heads], qk[:, heads:]
                v = qkv[:, q_size + kv_size :].view(rows, cfg.num_kv_heads, cfg.head_dim)
                if kv_rows is None:
                    write_kv(k_cache[i], v_cache[i], kv_slots, k[:t], v[:t])
                else:
                    write_kv(k_cache[i], v_cache[i], kv_slots, k[kv_rows], v[kv_rows])
                attn = attention(q, k_cache[i], v_cache[i], self.scale)
                if rows > t:
                    attn[t:].zero_()  # the padding rows, which no sequence's attention writes
                x = layer.o(attn.reshape(rows, q_size), residual=x)
                if rows <= block:
                    x = self._mlp(layer, x)
                else:  # in even blocks of rows (the MLP is row by row: each block's rows of x are its own)
                    for s in range(0, rows, block):
                        x[s : s + block] = self._mlp(layer, x[s : s + block])
        x = self._rms_norm(x[batch.logit_rows], self.norm)
        return self.lm_head(x).float()

    def _layers_in_one_call(self, attention, rows: int, t: int, block: int, kv_rows, kv_slots: torch.Tensor) -> bool:
        """Whether the step's layers go to `decode_layers` (kernels/csrc/decode_layers.cpp), which
        runs them as the loop in `forward` would, operator for operator: a step of decodes only,
        all taken by the C++ decode kernel, every product by the few-rows kernel, no padding rows,
        no MLP blocks, each row's KV written."""
        return (self.decode_layers is not None and rows == t and rows <= block and kv_rows is None
                and isinstance(attention, AttentionPlan) and bool(attention.decodes)
                and not attention.prefills and not attention.others and kv_slots.dtype == torch.long
                and all(rows <= p.small_limit for p in self._layer_products))

    def step_rows(self, t: int) -> tuple[int, int]:
        """(rows, MLP block) of a step of `t` tokens: the rows its products run, `t` padded where
        oneDNN multiplies them in half precision to one of the few row counts it keeps kernels for
        (`onednn_rows`, `PackedLinear.pads_rows`), and the rows each MLP call takes (`mlp_rows` at
        most, in even blocks, each so padded)."""
        blocks = -(-t // self.mlp_rows)
        block = -(-t // blocks)
        if self.layers and self.layers[0].qkv.pads_rows(block):
            block = onednn_rows(block)
            return blocks * block, block
        return t, block

    def _mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """x + down(SiLU(gate(norm(x))) * up(norm(x))): the layer's second half."""
        gate_up = layer.gate_up(self._rms_norm(x, layer.post_attention_norm))
        if self.fused is not None:
            act = self.fused.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate).mul_(up)
        return layer.down(act, residual=x)


# The fewest rows an MLP block takes: oneDNN's products want hundreds of rows to reach the machine's
# speed (blocks of 512 rows ran as fast as 1,024 on the Zen 4; 256 is a floor, not measured).
MIN_MLP_BLOCK_ROWS = 256


def mlp_block_rows(intermediate_size: int, itemsize: int, device: torch.device) -> int:
    """The most rows one MLP call takes: on the CPU, as many as keep the gate|up product's output
    within half the last-level cache (the other half for the weights streaming through, the input
    and SiLU's output), at least MIN_MLP_BLOCK_ROWS; no limit elsewhere."""
    if device.type != "cpu":
        return 1 << 62
    per_row = 2 * intermediate_size * itemsize
    return max(MIN_MLP_BLOCK_ROWS, (last_level_cache_bytes() or 32 << 20) // 2 // per_row)


@cache
def last_level_cache_bytes() -> int:
    """The size of the largest cache Linux reports for the first CPU (shared by its cores), 0 if none."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text[:-1] if unit > 1 else text
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=0)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
