"""PackedLinear, prepacked for oneDNN and on its F.linear fallback, against float64 F.linear."""

import pytest
import torch
import torch.nn.functional as F

from kvmesh.kernels.linear import PackedLinear

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


def onednn_supports(dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()  # bf16 needs AVX-512 or AVX-NE-CONVERT


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weight_is_prepacked_exactly_when_onednn_supports_its_dtype(dtype):
    weight, _, _ = make_case(48, 33, 1, dtype, with_bias=False)
    layer = PackedLinear(weight)
    if onednn_supports(dtype):
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
