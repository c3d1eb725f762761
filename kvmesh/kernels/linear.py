"""Linear layers with weights packed once for the CPU's matrix library.

torch's default CPU `F.linear` repacks the weight on every call, which costs more than the
arithmetic when few rows go through (decode steps). oneDNN can keep the weight in its own blocked
layout: `PackedLinear` does that when oneDNN is available for the weight's dtype and falls
back to `F.linear` otherwise. Tests hold both paths to float64 `F.linear`.

Where oneDNN has no kernel for a half-precision dtype (bfloat16 and float16 need AVX-512 or
AVX-NE-CONVERT: not on AMD Zen 1-3 or Intel before Skylake-SP), `F.linear` in that dtype runs
torch's reference kernel, 2-7x slower than oneDNN's float32 at every row count (AMD EPYC Zen 3, two
threads, the benchmark model's shapes: 32 rows 7.4-8.5 ms against 1.2-1.8 ms; one row 0.26-0.29
against 0.18-0.21). There a half-precision model multiplies in float32 (`half_linear_dtype`):
the weights are widened once at load, each input per call, and each product rounded back to the
model's dtype. bfloat16 and float16 products are exact in float32 and the kernels sum in float32
either way, so the result is the half-precision product's up to the order of the sums; the cost
is the weights' memory, twice theirs.

The same holds for bfloat16 where oneDNN has a kernel but the CPU has no bfloat16 dot products
(AVX-512 without AVX512-BF16 or AMX: Intel Skylake-SP to Ice Lake): oneDNN then widens both
operands before multiplying, and its bfloat16 products ran 3-4.7x slower than float32's from 32
rows up (Intel Xeon, Ice Lake, two threads, the benchmark model's shapes, float32 products of
the same bfloat16 values: 32 rows 1.1-4.3 ms against 0.6-1.3 ms; 1,024 rows 35-134 ms against
13-35), 1.5-1.6x slower at four rows, level at two; only at one row, where reading half the bytes
is what counts, were they faster (0.12-0.29 ms against 0.21-0.49). So such a CPU multiplies
bfloat16 in float32 too (`native_half_products`), and every batch gains (the engine issue's
workload: 101 -> 220-295 output tok/s, vLLM CPU about 100); a decode step's products still read
the bfloat16 weights as stored, from the few-rows kernel's layout, each pair widened to float32 in
registers (`small_rows_widens`), for the same bits as float32 weights: one stream of bench-125m in
bfloat16 29-37 -> 52-61 tok/s, where float32 gives 36-43 (Ice Lake, two threads,
bench/single_stream.py).
"""

from __future__ import annotations

import logging
import sys

import torch
import torch.nn.functional as F

from kvmesh.kernels import native

log = logging.getLogger("kvmesh.kernels")

# Up to this many rows a product goes to kvmesh's few-rows kernel where the layer has its copy of
# the weight (`small_rows_dtype`). The AVX-512 build was faster than oneDNN's kernels at 1-48 rows
# and level at 64 (AMD EPYC Zen 4, two threads, the benchmark model's twelve layers in turn:
# `bench/linear_rows.py`), slower from 128 (6-11%), so oneDNN keeps its own copy for the rest. The
# AVX2 build (tiles of 6 rows) was faster than oneDNN's AVX2 kernels at every row count on an
# AVX2-only CPU (AMD EPYC Zen 3, same script, float32: one row 22.4 -> 23.6 GB/s, 32 rows 109 -> 135
# GFLOP/s, 1,024 rows 147 -> 174), so there it takes every product (None) and its layout replaces
# oneDNN's: one copy of the weights.
SMALL_ROWS = {32: 48, 16: None}  # by the build's block width (native.small_linear_columns())
# The AVX2 build's float32 rows against bfloat16 weights widened in registers (`small_rows_widens`),
# against its float32 layout (AMD EPYC Zen 3, two threads, the benchmark model's layers in turn as
# `bench/linear_rows.py` runs them, both alternated): one row 7.6-8.4 ms a pass against 14.4-15.5, 8
# rows 15-16 against 20-22, 16 rows 25-29 against 28-31, level from 32 to 256 rows within the
# machine's noise, 10-14% slower at 512-1,024 (its tiles are of 5 rows, not 6: the registers). So a
# bfloat16 model there takes products of up to this many rows from its weights as stored, the rest
# (prompt steps) from the float32 layout, where both fit (`small_rows_plan`).
WIDENED_ROWS_AVX2 = 64
# Except bfloat16 on a CPU with AMX: there the kernel multiplies on the tile units too (from the same
# layout, `small_linear.cpp`) and is faster than oneDNN's tile kernels up to about 128 rows, where
# its weights come from memory (Intel Xeon with AMX-BF16, two threads, same script: 1-16 rows 4.7-6.3
# ms a pass against 6.5-8.1, 32 rows 1.34-1.50x faster, 64 rows 1.26-1.31x, 128 rows 1.07-1.19x,
# 160-192 rows 0.93-1.09x); oneDNN keeps prompt steps (at 256 rows 1.2-1.3x faster).
AMX_BF16_ROWS = 128


def onednn_rows(rows: int) -> int:
    """`rows` rounded up to a multiple of a sixteenth of the power of two below it: the row counts
    a forward pass gives oneDNN (`CausalLM.step_rows`). oneDNN compiles a kernel for each row count
    it multiplies and keeps the last 1,024 it compiled; a served worker's steps carry every count
    from a few decodes to the step budget (each prompt's length plus the decodes beside it), so most
    prompt steps compiled their own: 10-14 ms a step for the four products of a layer in bfloat16 on
    AMX's tile units, where the products themselves took 2-3 ms, and about 2 ms in float32 (Intel
    Xeon with AMX, two threads, the benchmark model's shapes at 150-520 rows). Rounded so, a step's
    products run at most 1/16 more rows, from a set of 16 counts per power of two (every count
    below 32); half-precision products only (`PackedLinear.pads_rows`)."""
    step = 1 << max(0, rows.bit_length() - 5)
    return -(-rows // step) * step


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        probe = torch.ones(1, weight.shape[1], dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        return packed
    except (RuntimeError, AttributeError):  # no oneDNN kernel for this dtype or CPU
        return None


def onednn_multiplies(dtype: torch.dtype) -> bool:
    """Whether oneDNN has a matrix-product kernel for `dtype` on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return True


def native_half_products(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` at least as fast as float32: oneDNN has a kernel for it
    and, for bfloat16, the CPU has bfloat16 dot products (AVX512-BF16 or AMX) for it to run on."""
    if not onednn_multiplies(dtype):
        return False
    if dtype == torch.bfloat16:
        probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
        if all(probe is None for probe in probes):  # a torch too old to say: trust oneDNN, as before
            return True
        return any(probe is not None and probe() for probe in probes)
    return True


def _memory_available(available: int | None) -> int:
    """`available`, or the system's available memory when None (what the extra weight copies must fit in)."""
    if available is not None:
        return available
    import psutil

    return psutil.virtual_memory().available


def half_linear_dtype(dtype: torch.dtype, device: torch.device, weight_bytes: int,
                      available: int | None = None) -> torch.dtype:
    """The dtype a model of `dtype` with `weight_bytes` of matrix weights multiplies them in on
    `device`: float32 for a half-precision model on a CPU that has no fast kernel for its dtype
    (`native_half_products`; see the module's docstring) when the float32 copies (`weight_bytes`
    more) fit in half of the memory available (`available`, default the system's), or where the
    few-rows kernel widens the weights as stored (`small_rows_widens`: `small_rows_plan` then keeps
    no float32 copy where none fits); its own dtype otherwise."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16) or native_half_products(dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if small_rows_widens(dtype, device):
        log.info("this CPU has no fast oneDNN kernel for %s: its matrix products run in float32, decode steps' "
                 "(or every one where no float32 copy fits) from the %s weights as stored", name, name)
        return torch.float32
    available = _memory_available(available)
    if 2 * weight_bytes > available:
        log.warning("this CPU has no fast oneDNN kernel for %s, whose matrix products then run several times slower "
                    "than float32; multiplying in float32 would take %d MiB more than the %d MiB available can spare "
                    "(half of it): left in %s (--dtype float32 trades the memory for the speed)", name,
                    weight_bytes >> 20, available >> 20, name)
        return dtype
    log.info("this CPU has no fast oneDNN kernel for %s: its matrix products run in float32 (%d MiB more weights), "
             "rounded to %s", name, weight_bytes >> 20, name)
    return torch.float32


def small_rows_dtype(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether kvmesh's few-rows kernel (`kernels/csrc/small_linear.cpp`) multiplies `dtype` on
    `device`: float32 on an AVX-512 or AVX2 CPU, bfloat16 on an AVX-512 CPU that has AVX512-BF16."""
    if device.type != "cpu" or native.small_linear() is None:
        return False
    if dtype == torch.bfloat16:
        probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
        return native.small_linear_columns() == 32 and probe is not None and probe()
    return dtype == torch.float32


def small_rows_widens(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the few-rows kernel multiplies float32 rows against weights of `dtype` as stored,
    widening each pair of values to float32 in registers (bfloat16, in the AVX-512 and AVX2 builds).
    A bfloat16 model that multiplies in float32 (`half_linear_dtype`) keeps its few-rows layout in
    bfloat16 then, so a decode step reads half the bytes of a float32 copy, for the same sums bit for
    bit (the same products of the same values, in the same order). Intel Xeon, Ice Lake (no
    AVX512-BF16), two threads, bench/linear_rows.py over the benchmark model's layers: one row 9-15
    ms a pass against 18-19 from the float32 layout, 16 rows 17.6 against 26, 32 rows 25-29 against
    34-40. It was as fast as oneDNN's float32 kernels or faster up to 512 rows, slower at 1,024
    (5-7%); the layers give it the float32 layout's limit (`SMALL_ROWS`) all the same: taking prompt
    steps too was level on the engine's offline workload within this machine's noise, and would
    change their sums from oneDNN's (the layer then keeps its float32 copy for oneDNN). The AVX2
    build widens too, faster than its float32 layout up to 16 rows and level to 64
    (`WIDENED_ROWS_AVX2`)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and native.small_linear() is not None


def small_rows_layout(dtype: torch.dtype, linear_dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
    """The dtype of the few-rows layout of a model of `dtype` whose products run in `linear_dtype`
    (`half_linear_dtype`): the model's own where the products are widened to float32 from it
    (`small_rows_widens`), `linear_dtype` where the kernel multiplies that (`small_rows_dtype`),
    None where the kernel takes neither."""
    if linear_dtype == torch.float32 and dtype != linear_dtype and small_rows_widens(dtype, device):
        return dtype
    return linear_dtype if small_rows_dtype(linear_dtype, device) else None


def small_rows_limit(dtype: torch.dtype, widened: bool = False) -> int:
    """Rows up to which the few-rows kernel takes a product of `dtype` from a layer that has its
    layout (`SMALL_ROWS`, `AMX_BF16_ROWS`; `WIDENED_ROWS_AVX2` for float32 products from a widened
    bfloat16 layout beside a float32 one); sys.maxsize where it takes every product."""
    if dtype == torch.bfloat16 and native.amx_tiles() and native.tile_products():
        return AMX_BF16_ROWS
    if widened and small_rows_only():
        return WIDENED_ROWS_AVX2
    limit = SMALL_ROWS[native.small_linear_columns()]
    return sys.maxsize if limit is None else limit


def small_rows_only() -> bool:
    """Whether the few-rows kernel takes every product of a layer that has its layout in the
    products' dtype (this CPU's build: `SMALL_ROWS`), which then replaces oneDNN's copy of the
    weights instead of adding one."""
    return native.small_linear() is not None and SMALL_ROWS[native.small_linear_columns()] is None


def small_rows_plan(layout: torch.dtype | None, linear_dtype: torch.dtype, weight_bytes: int, layout_bytes: int,
                    available: int | None = None) -> str:
    """How a model's layers hold the few-rows kernel's layout (`layout`, `small_rows_layout`) of
    weights multiplied in `linear_dtype`: "only" where it takes every product, with no other copy
    (this build, in the products' dtype: `small_rows_only`); "beside" where it takes decode steps'
    products beside a float32 copy (`weight_bytes`: oneDNN's, or in the AVX2 build the kernel's
    float32 layout) and both fit in half of the memory available (`available`, default the
    system's); "none" where there is no layout or the second copy does not fit. A layout widened
    to float32 from the model's own bfloat16 (`small_rows_widens`) takes every product where the
    float32 copy does not fit beside it ("only"): the weights as stored, at about float32's speed
    (where oneDNN's bfloat16 kernels would multiply 3-4.7x slower than float32, the module's
    docstring), where a model of several GiB gets no float32 copy."""
    if layout is None:
        return "none"
    if small_rows_only() and layout == linear_dtype:
        return "only"
    available = _memory_available(available)
    if 2 * (weight_bytes + layout_bytes) <= available:
        return "beside"
    if layout != linear_dtype:  # widened from the stored weights: they carry every product
        log.info("matrix products run in float32 from the %s weights as stored (the few-rows kernel widens them): "
                 "a float32 copy (%d MiB) beside them does not fit in half of the %d MiB available",
                 str(layout).removeprefix("torch."), weight_bytes >> 20, available >> 20)
        return "only"
    log.info("decode steps' matrix products stay in oneDNN: a second copy of the weights for the few-rows "
             "kernel (%d MiB) does not fit in half of the %d MiB available", layout_bytes >> 20, available >> 20)
    return "none"


def _small_pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight in the few-rows kernel's layout: blocks of C output columns (32 in the AVX-512
    build, 16 in the AVX2 one; the last block padded with zeros), each `[K][C]` in float32,
    `[K/2][C][2]` (pairs of inputs) in bfloat16."""
    n, k = weight.shape
    cols = native.small_linear_columns()
    blocks = -(-n // cols)
    w = F.pad(weight, (0, 0, 0, blocks * cols - n))
    if w.dtype == torch.float32:
        return w.view(blocks, cols, k).permute(0, 2, 1).contiguous()
    return w.view(blocks, cols, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def _small_unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The `[n, K]` weight back from `_small_pack`'s layout."""
    if packed.dim() == 3:  # float32 [blocks][K][C]
        return packed.permute(0, 2, 1).reshape(-1, packed.shape[1])[:n]
    blocks, half, cols, _ = packed.shape
    return packed.permute(0, 2, 1, 3).reshape(blocks * cols, 2 * half)[:n]


class PackedLinear:
    """y = x @ weight.T + bias (+ residual), with the weight prepacked for oneDNN when that is possible.
    With `compute_dtype` (float32 for a half-precision weight, `half_linear_dtype`), the weight and
    bias are kept in that dtype, each input is converted to it, and the product is rounded back to the
    input's dtype before the residual is added (two roundings, as transformers' `residual + proj(x)`).
    With `small_rows` (`small_rows_plan`), the weight in the few-rows kernel's layout takes products
    of up to `small_limit` rows (decode steps; `small_rows_limit`), beside oneDNN's copy, or every product
    with no other copy where that build is the faster at every row count (`small_rows_only`); that
    layout keeps a bfloat16 weight as stored where its products run in float32 and the kernel widens
    it (`small_rows_layout`), and in the AVX2 build the rest go to the kernel's float32 layout
    (`rest`) instead of oneDNN; with `small_only` too (`small_rows_plan`), that layout takes every
    product and the layer keeps no other copy."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True,
                 compute_dtype: torch.dtype | None = None, small_rows: bool = False, small_only: bool = False):
        self.out_features, self.in_features = weight.shape
        stored = weight
        self.compute_dtype = compute_dtype if compute_dtype not in (None, weight.dtype) else None
        self.dtype = self.compute_dtype or weight.dtype  # the products'
        if self.compute_dtype is not None:
            bias = None if bias is None else bias.to(self.compute_dtype)
        self.bias = bias
        self.small, self.small_limit = None, 0
        layout = small_rows_layout(stored.dtype, self.dtype, weight.device) if small_rows or small_only else None
        if layout is not None and layout != torch.float32 and self.in_features % 2:
            layout = None  # bfloat16 pairs inputs
        if layout is not None:
            self.small_limit = sys.maxsize if small_only else small_rows_limit(self.dtype, widened=layout != self.dtype)
        # the weight in the products' dtype, where oneDNN's copy or the few-rows layout is in it
        if self.compute_dtype is not None and (self.small_limit < sys.maxsize or layout == self.compute_dtype):
            weight = weight.to(self.compute_dtype)
        if layout is not None:  # stored as loaded where the kernel widens it
            self.small = _small_pack((stored if layout == stored.dtype else weight).contiguous())
        self.packed = self.weight = self.rest = None
        if layout is not None and self.small_limit < sys.maxsize and small_rows_only():  # the AVX2 build's float32 layout
            self.rest = _small_pack(weight.contiguous())
        elif self.small_limit < sys.maxsize:
            self.packed = _pack(weight) if pack else None
            # The plain weight is only needed by the fallback path.
            self.weight = weight if self.packed is None else None

    def add_onednn_copy(self) -> None:
        """Gives a layer whose few-rows layouts take every product oneDNN's copy too (in place of
        the AVX2 build's float32 `rest`), so that lowering `small_limit` sends products to oneDNN
        (benchmarks compare the two)."""
        self.rest = None
        if self.packed is None and self.weight is None:
            weight = _small_unpack(self.small, self.out_features).to(self.dtype).contiguous()
            self.packed = _pack(weight)
            self.weight = weight if self.packed is None else None

    def pads_rows(self, rows: int) -> bool:
        """Whether a product of `rows` rows is best given `onednn_rows(rows)` rows: where oneDNN's
        copy takes it in half precision. The few-rows kernel and `F.linear` compile nothing by row
        count, and oneDNN's float32 kernels compiled in about 2 ms a step, less than the padding
        rows cost where float32 products are bound by the multiply-adds (served float32 at 4/s,
        the same arrivals, without and with padding alternated twice: 411 and 405 against 402 and
        393 output tok/s; Intel Xeon with AMX, two threads)."""
        return self.packed is not None and rows > self.small_limit and self.dtype != torch.float32

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`residual`, when given, is added to the product (in the same oneDNN call where packed)."""
        if self.compute_dtype is not None:
            y = self._product(x.to(self.compute_dtype), None).to(x.dtype)
            return y if residual is None else y.add_(residual)
        return self._product(x, residual)

    def _product(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2 and (x.shape[0] <= self.small_limit or self.rest is not None):
            if residual is not None:
                residual = residual.contiguous()
            layout = self.small if x.shape[0] <= self.small_limit else self.rest
            return native.small_linear()(x.contiguous(), layout, self.out_features, self.bias, residual)
        if x.dim() != 2 and self.packed is None and self.weight is None:  # the few-rows layout is all there is
            rows = x.reshape(-1, self.in_features)
            flat = None if residual is None else residual.reshape(-1, self.out_features)
            return self._product(rows, flat).view(*x.shape[:-1], self.out_features)
        if self.packed is not None:
            if residual is not None:
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        y = F.linear(x, self.weight, self.bias)
        return y if residual is None else y.add_(residual)
