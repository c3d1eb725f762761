"""PackedLinear, prepacked for oneDNN and on its F.linear fallback, against float64 F.linear."""

import sys

import pytest
import torch
import torch.nn.functional as F

from kvmesh.kernels import linear as linear_module
from kvmesh.kernels.linear import (
    PackedLinear,
    half_linear_dtype,
    native_half_products,
    onednn_multiplies,
    onednn_rows,
    small_rows_dtype,
    small_rows_layout,
    small_rows_only,
    small_rows_plan,
    small_rows_widens,
)

SHAPES = [(1, 1), (48, 33), (256, 64), (130, 257)]  # (out_features, in_features)


def make_case(out_features, in_features, batch, dtype, with_bias, seed=0):
    """Weights scaled like a trained layer's (outputs of order one), so a tolerance means the same for every shape."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=g) * in_features**-0.5).to(dtype)
    bias = torch.randn(out_features, generator=g).to(dtype) if with_bias else None
    x = torch.randn(batch, in_features, generator=g).to(dtype)
    return weight, bias, x


def float64_linear(x, weight, bias):
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weight_is_prepacked_exactly_when_onednn_supports_its_dtype(dtype):
    weight, _, _ = make_case(48, 33, 1, dtype, with_bias=False)
    layer = PackedLinear(weight)
    if onednn_multiplies(dtype):
        assert layer.packed is not None and layer.weight is None
    else:  # this CPU has no oneDNN kernel for the dtype: the plain weight serves F.linear
        assert layer.packed is None and layer.weight is weight


def test_pack_false_keeps_the_plain_weight():
    weight, _, _ = make_case(48, 33, 1, torch.float32, with_bias=False)
    layer = PackedLinear(weight, pack=False)
    assert layer.packed is None and layer.weight is weight


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "fallback"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_float32_equals_float64_linear(shape, batch, with_bias, pack):
    weight, bias, x = make_case(*shape, batch, torch.float32, with_bias)
    y = PackedLinear(weight, bias, pack=pack)(x)
    assert y.dtype == torch.float32 and y.shape == (batch, shape[0])
    torch.testing.assert_close(y.double(), float64_linear(x, weight, bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "fallback"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_bfloat16_is_close_to_float64_linear(shape, batch, with_bias, pack):
    weight, bias, x = make_case(*shape, batch, torch.bfloat16, with_bias)
    y = PackedLinear(weight, bias, pack=pack)(x)
    assert y.dtype == torch.bfloat16 and y.shape == (batch, shape[0])
    # bfloat16 keeps 8 significant bits: the output's own rounding is up to 0.4 %
    torch.testing.assert_close(y.double(), float64_linear(x, weight, bias), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "fallback"])
def test_leading_dimensions_and_strided_inputs_give_the_same_result(pack):
    weight, bias, _ = make_case(40, 64, 1, torch.float32, with_bias=True)
    layer = PackedLinear(weight, bias, pack=pack)
    x3d = torch.randn(3, 5, 64)
    torch.testing.assert_close(layer(x3d).double(), float64_linear(x3d, weight, bias), atol=1e-5, rtol=1e-5)
    strided = torch.randn(9, 128)[:, ::2]  # every other column: not contiguous
    torch.testing.assert_close(layer(strided).double(), float64_linear(strided, weight, bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "fallback"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_a_residual_is_added_to_the_product(dtype, pack, with_bias):
    """The model adds the residual stream inside the output projections' call (oneDNN's add post-op)."""
    weight, bias, x = make_case(48, 33, 7, dtype, with_bias)
    residual = torch.randn(7, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    kept = residual.clone()
    y = PackedLinear(weight, bias, pack=pack)(x, residual=residual)
    assert y.dtype == dtype and y.shape == (7, 48)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), float64_linear(x, weight, bias) + residual.double(), atol=tolerance,
                               rtol=tolerance)
    assert torch.equal(residual, kept)  # the residual itself is not written
    if dtype == torch.float32:  # float32: the same bits as adding after the product, as transformers does
        assert torch.equal(y, PackedLinear(weight, bias, pack=pack)(x) + residual)


def rounded(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return y.to(dtype).double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "fallback"])
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_half_precision_product_in_float32_is_the_exact_product_rounded_once(shape, batch, pack, dtype):
    """Half-precision products are exact in float32 and the sums run in float32: the output is the
    float64 product rounded to the model's dtype, give or take one unit in the last place (the
    order of the sums)."""
    weight, bias, x = make_case(*shape, batch, dtype, with_bias=True)
    layer = PackedLinear(weight, bias, pack=pack, compute_dtype=torch.float32)
    assert layer.compute_dtype == torch.float32
    assert (layer.packed is not None) == (pack and torch.backends.mkldnn.is_available())  # float32 packs anywhere
    y = layer(x)
    assert y.dtype == dtype and y.shape == (batch, shape[0])
    exact = float64_linear(x, weight, bias)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    torch.testing.assert_close(y.double(), rounded(exact, dtype), atol=1e-6, rtol=ulp)


def test_a_residual_is_added_after_the_float32_product_is_rounded():
    """As transformers' `residual + proj(x)` in bfloat16: the product rounded, then the sum rounded."""
    weight, bias, x = make_case(48, 33, 7, torch.bfloat16, with_bias=True)
    residual = torch.randn(7, 48, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    layer = PackedLinear(weight, bias, compute_dtype=torch.float32)
    assert torch.equal(layer(x, residual=residual), layer(x) + residual)


def test_a_compute_dtype_equal_to_the_weights_changes_nothing():
    weight, bias, x = make_case(48, 33, 7, torch.float32, with_bias=True)
    layer = PackedLinear(weight, bias, compute_dtype=torch.float32)
    assert layer.compute_dtype is None
    assert torch.equal(layer(x), PackedLinear(weight, bias)(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_multiplies_in_float32_only_where_the_cpu_has_no_fast_kernel_and_memory_allows(dtype):
    cpu, plenty, gib = torch.device("cpu"), 1 << 40, 1 << 30
    expected = dtype if native_half_products(dtype) else torch.float32
    assert half_linear_dtype(dtype, cpu, gib, available=plenty) == expected
    # float32 copies of 1 GiB of weights need 2 GiB available: with less, the model keeps its dtype,
    # except where the few-rows kernel widens the weights as stored (it then needs no float32 copy)
    short = torch.float32 if small_rows_widens(dtype, cpu) and not native_half_products(dtype) else dtype
    assert half_linear_dtype(dtype, cpu, gib, available=2 * gib - 1) == short
    assert half_linear_dtype(torch.float32, cpu, gib, available=plenty) == torch.float32
    assert half_linear_dtype(dtype, torch.device("cuda"), gib, available=plenty) == dtype


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def test_bfloat16_is_multiplied_as_stored_only_on_a_cpu_with_bfloat16_dot_products():
    """oneDNN has bfloat16 kernels on any AVX-512 CPU, but without AVX512-BF16 or AMX they widen
    both operands to float32 first and ran 3-4.7x slower than float32 (kernels/linear.py): there a
    bfloat16 model multiplies in float32. The CPU's own flags say which this machine is."""
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags on this system")
    dot = bool({"avx512_bf16", "amx_bf16"} & flags)
    assert native_half_products(torch.bfloat16) == (dot and onednn_multiplies(torch.bfloat16))
    expected = torch.bfloat16 if native_half_products(torch.bfloat16) else torch.float32
    assert half_linear_dtype(torch.bfloat16, torch.device("cpu"), 1 << 20, available=1 << 40) == expected


def test_a_torch_that_cannot_say_what_the_cpu_has_keeps_onednns_word(monkeypatch):
    """An older torch may have neither probe: then bfloat16 is multiplied as stored wherever oneDNN has
    a kernel for it, as before the probes were read."""
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert native_half_products(torch.bfloat16) == onednn_multiplies(torch.bfloat16)


CPU = torch.device("cpu")


def small_layer(weight, bias=None, **kwargs) -> PackedLinear:
    """A layer with the few-rows kernel's copy, or a skip where this CPU has no such kernel for the dtype."""
    if not small_rows_dtype(weight.dtype, CPU):
        pytest.skip(f"no few-rows kernel for {weight.dtype} on this CPU (it needs AVX2 or AVX-512; AVX512-BF16 for bfloat16)")
    layer = PackedLinear(weight, bias, small_rows=True, **kwargs)
    assert layer.small is not None
    return layer


@pytest.fixture
def small_calls(monkeypatch):
    """Counts the rows of each product the few-rows kernel computes."""
    rows = []
    op = linear_module.native.small_linear()
    if op is not None:
        def counted(x, *args):
            rows.append(x.shape[0])
            return op(x, *args)

        monkeypatch.setattr(linear_module.native, "small_linear", lambda: counted)
    return rows


SMALL_SHAPES = [(1, 2), (48, 34), (256, 64), (130, 258), (1280, 768)]  # bfloat16 pairs inputs: even in_features


def build_limit() -> int:
    """Rows the few-rows kernel takes in this build: 48 with AVX-512 (oneDNN the rest), all with AVX2."""
    return {32: 48, 16: sys.maxsize}[linear_module.native.small_linear_columns()]


def default_limit(dtype) -> int:
    """Rows a layer gives the kernel by default: the build's, but 128 for bfloat16 where the CPU has
    AMX (the kernel multiplies on the tile units there; oneDNN's tile kernels are faster beyond)."""
    return linear_module.AMX_BF16_ROWS if dtype == torch.bfloat16 and "amx_bf16" in cpu_flags() else build_limit()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("batch", [1, 7, 13, 16, 17, 33, 48, 49, 65, 128, 300])
@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_few_rows_kernel_equals_float64_linear(shape, batch, with_bias, dtype, small_calls):
    """Up to the layer's limit (48 rows with AVX-512, every product with AVX2, 128 for bfloat16 on an
    AMX CPU) the product is the few-rows kernel's (blocks of 32 or 16 columns, the last one padded;
    tiles of 12 or 6 rows, rows split among the threads too where there are few blocks; on AMX,
    pieces of 16 rows on the tile units where in_features is a multiple of 32, the last piece
    zero-padded), beyond it oneDNN's: both within the dtype's rounding of float64."""
    weight, bias, x = make_case(*shape, batch, dtype, with_bias)
    layer = small_layer(weight, bias)
    assert layer.small_limit == default_limit(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (batch, shape[0])
    assert small_calls == ([batch] if batch <= layer.small_limit else [])
    exact = float64_linear(x, weight, bias)
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), exact, atol=1e-5, rtol=1e-5)
    else:  # products exact, sums in float32, one rounding: the float64 result rounded, give or take a unit
        torch.testing.assert_close(y.double(), rounded(exact, dtype), atol=1e-6, rtol=2.0**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_the_few_rows_kernel_adds_the_residual_as_onednn_does(dtype, with_bias, small_calls):
    weight, bias, x = make_case(130, 258, 7, dtype, with_bias)
    residual = torch.randn(7, 130, generator=torch.Generator().manual_seed(1)).to(dtype)
    kept = residual.clone()
    layer = small_layer(weight, bias)
    layer.small_limit = build_limit()
    y = layer(x, residual=residual)
    assert small_calls == [7]
    assert torch.equal(residual, kept)
    exact = float64_linear(x, weight, bias) + residual.double()
    if dtype == torch.float32:  # the same bits as adding after the product, as transformers does
        assert torch.equal(y, layer(x) + residual)
        torch.testing.assert_close(y.double(), exact, atol=1e-5, rtol=1e-5)
    else:  # the sum rounded once, as oneDNN's add post-op
        torch.testing.assert_close(y.double(), rounded(exact, dtype), atol=1e-6, rtol=2.0**-7)


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("shape", [(256, 64), (48, 34)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(dtype, shape, threads):
    """Each output is summed in one order whatever the number of rows and threads: a sequence's
    logits in a decode step are the same bits alone or beside others (48x34 has fewer blocks than
    threads can share, so many rows are split among the threads by rows as well; on AMX, 256x64
    goes in 16-row pieces on the tile units, the last one zero-padded, and 48x34 does not)."""
    weight, bias, _ = make_case(*shape, 1, dtype, with_bias=True)
    layer = small_layer(weight, bias)
    rows = min(layer.small_limit, 200) - 3  # a short last tile (or piece)
    x = make_case(*shape, rows, dtype, with_bias=True)[2]
    kept = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = layer(x)
        assert layer.small_limit >= rows
        for i in (0, 5, 6, 11, 12, 15, 16, 31, 32, 44, 47, 48, 97, 111, 112, rows - 1):  # tiles' and chunks' edges
            if i < rows:
                assert torch.equal(layer(x[i : i + 1]), together[i : i + 1])
    finally:
        torch.set_num_threads(kept)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_gives_the_kernel_the_rows_it_is_faster_at(dtype, small_calls):
    """Decode-sized products go to the few-rows kernel, up to the build's limit, or 128 rows for
    bfloat16 on an AMX CPU (prompt steps' products go to oneDNN's tile kernels there)."""
    weight, bias, _ = make_case(130, 258, 1, dtype, with_bias=True)
    layer = small_layer(weight, bias)
    counts = (1, 2, 7, 48, 49, 128, 129, 300)
    for rows in counts:
        layer(make_case(130, 258, rows, dtype, with_bias=True)[2])
    assert small_calls == [r for r in counts if r <= default_limit(dtype)]
    if dtype == torch.bfloat16 and "amx_bf16" in cpu_flags():
        assert small_calls == [1, 2, 7, 48, 49, 128]


def test_the_few_rows_kernel_takes_float32_products_of_half_precision_weights():
    """A bfloat16 layer that multiplies in float32 keeps its few-rows layout in bfloat16, which the
    kernel widens (half the bytes a decode step reads), for products up to its limit, and a
    float32 copy for the rest (oneDNN's; in the AVX2 build the kernel's float32 layout); a row's
    result is the float32 layer's over the same values, bit for bit."""
    weight, bias, x = make_case(130, 258, 5, torch.bfloat16, with_bias=True)
    if not small_rows_dtype(torch.float32, CPU):
        pytest.skip("no few-rows kernel on this CPU (it needs AVX2 or AVX-512)")
    layer = PackedLinear(weight, bias, compute_dtype=torch.float32, small_rows=True)
    assert small_rows_widens(torch.bfloat16, CPU)
    assert small_rows_layout(torch.bfloat16, torch.float32, CPU) == torch.bfloat16
    assert layer.small is not None and layer.small.dtype == torch.bfloat16
    avx2 = small_rows_only()
    assert layer.small_limit == (linear_module.WIDENED_ROWS_AVX2 if avx2 else linear_module.SMALL_ROWS[32])
    assert (layer.rest is not None, layer.packed is not None) == ((True, False) if avx2 else (False, True))
    torch.testing.assert_close(layer(x).double(), rounded(float64_linear(x, weight, bias), torch.bfloat16),
                               atol=1e-6, rtol=2.0**-7)
    plain = PackedLinear(weight.float(), bias.float(), small_rows=True)
    assert plain.small.dtype == torch.float32
    # past the limit the AVX2 build's float32 layout gives the same bits; oneDNN sums in its own order
    beyond = (65, 300) if avx2 else ()
    for rows in (1, 4, 5, 6, 12, 13, 48, layer.small_limit, *beyond):
        rows_x = make_case(130, 258, rows, torch.bfloat16, with_bias=True, seed=rows)[2]
        assert torch.equal(layer(rows_x), plain(rows_x.float()).to(torch.bfloat16)), rows
    batched = make_case(130, 258, 300, torch.bfloat16, with_bias=True, seed=3)[2]
    assert torch.equal(layer(batched.view(3, 100, 258)), layer(batched).view(3, 100, 130))
    layer.add_onednn_copy()  # benchmarks: the rest to oneDNN, which then takes what small_limit leaves it
    assert layer.rest is None and (layer.packed is not None or layer.weight is not None)
    layer.small_limit = 0
    torch.testing.assert_close(layer(batched).double(), rounded(float64_linear(batched, weight, bias), torch.bfloat16),
                               atol=1e-6, rtol=2.0**-7)


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", [(1, 2), (48, 34), (130, 258), (1280, 768)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_widened_bfloat16_weights_give_the_float32_kernels_bits(shape, with_bias, threads):
    """The kernel's float32 rows against a bfloat16 layout (each pair widened in registers) sum the
    same products in the same order as against the float32 layout of the same values: equal bits,
    bias and residual included, at every tile size and thread split."""
    if not small_rows_widens(torch.bfloat16, CPU):
        pytest.skip("no few-rows kernel on this CPU (it needs AVX2 or AVX-512)")
    weight, bias, _ = make_case(*shape, 1, torch.bfloat16, with_bias)
    op = linear_module.native.small_linear()
    narrow, wide = linear_module._small_pack(weight), linear_module._small_pack(weight.float())
    bias = None if bias is None else bias.float()
    kept = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 4, 5, 6, 11, 12, 13, 25, 48, 100):  # tiles of 5 (AVX2, widened), 6 and 12
            x = make_case(*shape, rows, torch.float32, with_bias=False, seed=rows)[2]
            residual = torch.randn(rows, shape[0], generator=torch.Generator().manual_seed(rows))
            assert torch.equal(op(x, narrow, shape[0], bias, None), op(x, wide, shape[0], bias, None))
            assert torch.equal(op(x, narrow, shape[0], bias, residual), op(x, wide, shape[0], bias, residual))
    finally:
        torch.set_num_threads(kept)
    with pytest.raises(RuntimeError, match="even number of in_features"):
        odd = torch.randn(3, 33)
        op(odd, linear_module._small_pack(torch.randn(4, 34).to(torch.bfloat16)), 4, None, None)


def test_a_layer_whose_widened_weights_carry_every_product_keeps_no_float32_copy():
    """Where no float32 copy fits (`small_rows_plan` "only"), a bfloat16 layer that multiplies in
    float32 keeps its weights as stored, in the few-rows layout, and that layout takes every
    product, prompt-sized and batched ones too: the float32 few-rows layout's bits, rounded to
    bfloat16, and within bfloat16's rounding of float64."""
    if not small_rows_widens(torch.bfloat16, CPU):
        pytest.skip("no few-rows kernel on this CPU (it needs AVX2 or AVX-512)")
    weight, bias, _ = make_case(130, 258, 1, torch.bfloat16, with_bias=True)
    layer = PackedLinear(weight, bias, compute_dtype=torch.float32, small_rows=True, small_only=True)
    assert layer.small.dtype == torch.bfloat16 and layer.packed is None and layer.weight is None
    assert layer.small_limit == sys.maxsize
    plain = PackedLinear(weight.float(), bias.float(), small_rows=True, small_only=True)
    for rows in (1, 48, 49, 300):
        x = make_case(130, 258, rows, torch.bfloat16, with_bias=True, seed=rows)[2]
        y = layer(x)
        assert y.dtype == torch.bfloat16 and torch.equal(y, plain(x.float()).to(torch.bfloat16))
        torch.testing.assert_close(y.double(), rounded(float64_linear(x, weight, bias), torch.bfloat16),
                                   atol=1e-6, rtol=2.0**-7)
    three = make_case(130, 258, 64, torch.bfloat16, with_bias=True)[2]
    assert torch.equal(layer(three.view(4, 16, 258)), layer(three).view(4, 16, 130))


def test_the_few_rows_kernel_is_where_the_cpu_has_it_and_its_copy_where_memory_allows():
    """float32 in the AVX-512 and AVX2 builds, bfloat16 in the AVX-512 build on a CPU with AVX512-BF16."""
    flags = cpu_flags()
    isa = linear_module.native._isa()
    built = linear_module.native.small_linear() is not None
    assert built == (isa in ("avx512", "avx2") and linear_module.native.fused_ops() is not None)
    assert small_rows_dtype(torch.float32, CPU) == built
    if flags:
        assert small_rows_dtype(torch.bfloat16, CPU) == (built and isa == "avx512" and "avx512_bf16" in flags)
        # bfloat16 on AMX's tile units where the CPU has them (the process asks Linux for the tiles)
        assert linear_module.native.tile_products() == (built and isa == "avx512" and "amx_bf16" in flags)
    assert not small_rows_dtype(torch.float16, CPU)
    assert not small_rows_dtype(torch.float32, torch.device("cuda"))
    assert small_rows_only() == (built and linear_module.native.small_linear_columns() == 16)  # the AVX2 build
    gib = 1 << 30
    # a second copy beside oneDNN's where both fit in half of the memory; the only copy needs no room
    f32 = torch.float32
    layout = small_rows_layout(f32, f32, CPU)
    assert layout == (f32 if built else None)
    only = "only" if small_rows_only() else None
    assert small_rows_plan(layout, f32, gib, gib, available=4 * gib) == (only or "beside" if built else "none")
    assert small_rows_plan(layout, f32, gib, gib, available=4 * gib - 1) == (only or "none")
    assert small_rows_plan(None, f32, gib, 0, available=1 << 50) == "none"
    # a bfloat16 layout widened for float32 products: beside a float32 copy (oneDNN's, or the AVX2
    # build's float32 layout) where both fit, alone where they do not (the weights as stored carry
    # every product)
    assert small_rows_plan(torch.bfloat16, f32, 2 * gib, gib, available=6 * gib) == ("beside" if built else "none")
    assert small_rows_plan(torch.bfloat16, f32, 2 * gib, gib, available=6 * gib - 1) == "only"
    # without the copy a layer is as before: oneDNN's packed weight only
    weight, _, _ = make_case(48, 34, 1, torch.float32, with_bias=False)
    assert PackedLinear(weight).small is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_where_the_kernel_takes_every_product_a_layer_holds_no_other_copy(dtype):
    """With AVX2 the kernel's layout is the layer's only weight (no oneDNN copy, no plain one), and
    it also takes inputs with more than two dimensions; `add_onednn_copy` (for benchmarks) gives
    oneDNN the same weight back."""
    weight, bias, x = make_case(130, 258, 64, dtype, with_bias=True)
    layer = small_layer(weight, bias)
    if not small_rows_only():
        assert layer.packed is not None or layer.weight is not None
        pytest.skip("this build's few-rows kernel takes decode steps only, beside oneDNN's copy")
    assert layer.packed is None and layer.weight is None
    three = x.view(4, 16, 258)
    torch.testing.assert_close(layer(three), layer(x).view(4, 16, 130), atol=0, rtol=0)
    residual = torch.randn(4, 16, 130, generator=torch.Generator().manual_seed(2)).to(dtype)
    torch.testing.assert_close(layer(three, residual=residual), layer(x, residual=residual.view(64, 130)).view(4, 16, 130),
                               atol=0, rtol=0)
    layer.add_onednn_copy()
    layer.small_limit = 0
    assert layer.packed is not None or torch.equal(layer.weight, weight)
    torch.testing.assert_close(layer(x).double(), float64_linear(x, weight, bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_layout_gives_the_weight_back(dtype):
    if linear_module.native.small_linear() is None:
        pytest.skip("no few-rows kernel on this CPU (it needs AVX2 or AVX-512)")
    weight = make_case(130, 258, 1, dtype, with_bias=False)[0]
    assert torch.equal(linear_module._small_unpack(linear_module._small_pack(weight), 130), weight)


def test_onednn_is_given_few_row_counts_each_at_most_a_sixteenth_above_the_rows():
    counts = {onednn_rows(rows) for rows in range(1, 4097)}
    for rows in range(1, 4097):
        padded = onednn_rows(rows)
        assert rows <= padded <= rows + rows // 16 and onednn_rows(padded) == padded, (rows, padded)
    # every count below 32, then 16 per power of two: every step size up to 4,096 tokens takes 144
    # kernels per weight shape, within oneDNN's cache of 1,024 for a layer's four shapes
    assert len(counts) == 31 + 7 * 16 + 1, sorted(counts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_pads_rows_where_onednn_multiplies_them_in_half_precision(dtype):
    weight, _, _ = make_case(64, 32, 1, dtype, with_bias=False)
    layer = PackedLinear(weight, small_rows=True)
    if layer.packed is None:  # the few-rows kernel or F.linear takes every product: nothing compiled by rows
        assert not layer.pads_rows(1) and not layer.pads_rows(4096)
        return
    half = dtype != torch.float32
    assert layer.pads_rows(layer.small_limit + 1) == half and not layer.pads_rows(layer.small_limit)
    assert not PackedLinear(weight, pack=False).pads_rows(4096)
    assert not PackedLinear(weight, compute_dtype=torch.float32).pads_rows(4096)  # bfloat16 multiplied in float32
