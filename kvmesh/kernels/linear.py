"""Linear layers with weights packed once for the CPU's matrix library.

torch's default CPU `F.linear` repacks the weight on every call, which costs more than the
arithmetic when few rows go through (decode steps). oneDNN can keep the weight in its own blocked
layout: `PackedLinear` does that when oneDNN is available for the weight's dtype and falls
back to `F.linear` otherwise. Tests hold both paths to float64 `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


class PackedLinear:
    """y = x @ weight.T + bias (+ residual), with the weight prepacked for oneDNN when that is possible."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = _pack(weight) if pack else None
        # The plain weight is only needed by the fallback path.
        self.weight = weight if self.packed is None else None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`residual`, when given, is added to the product (in the same oneDNN call where packed)."""
        if self.packed is not None:
            if residual is not None:
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        y = F.linear(x, self.weight, self.bias)
        return y if residual is None else y.add_(residual)
