"""Frozen CPU linear layers with their weights packed once for oneDNN (serving only)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

# Rows a decode step is expected to have: oneDNN picks the packed layout for it (any
# number of rows works).
PACK_ROWS_HINT = 64


class PackedLinear(nn.Module):
    """A frozen CPU ``nn.Linear`` whose weight oneDNN reorders once into its blocked
    layout (what inductor does when it freezes a CPU model), instead of MKL's sgemm packing
    it again at every call. For the few rows of a decode step that packing costs about as
    much as the product: on SmolLM2 with 2 cores, 128 rows, 50-58 -> 62-69 GFLOP/s for the
    decoder's layers and 151 -> 99 ms for the 49,152-row output layer. A row's result is
    also the same bits whatever the other rows of the batch (MKL's is not).

    Only the packed weight is kept, except where the weight is shared with another module
    (tied embeddings), which holds it anyway."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor, tied: bool):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed = packed
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.tied = linear if tied else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], ""
        )
        return out

    def unpacked(self, memo: dict[int, Any]) -> nn.Linear:
        """A plain ``nn.Linear`` with the same weights (a tied one stays tied through
        ``memo``, the memo of a ``deepcopy`` of the whole model)."""
        if self.tied is not None:
            linear: nn.Linear = copy.deepcopy(self.tied, memo)
            return linear
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.weight = nn.Parameter(self.packed.to_dense(), requires_grad=False)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.clone(), requires_grad=False)
        return linear


def pack_linear(linear: nn.Module, tied: bool = False) -> PackedLinear | None:
    """``linear`` packed for oneDNN, or None where it cannot be: not a plain fp32 or bf16
    ``nn.Linear`` on the CPU, oneDNN missing, or its product differing from
    ``F.linear``'s (checked on a random input: within 1e-4 in fp32; in bf16, within one
    rounding of bf16's 8-bit significand, 2^-7 relative, as both sum in fp32 and round
    the sum once)."""
    if type(linear) is not nn.Linear or not torch.backends.mkldnn.is_available():
        return None
    weight = linear.weight.detach()
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    tolerance = 1e-4 if weight.dtype == torch.float32 else 2**-7
    try:
        packed = PackedLinear(
            linear, torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT), tied
        )
        x = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0))
        x = x.to(weight.dtype)
        with torch.inference_mode():
            want = linear(x)
            scale = float(want.abs().max())
            ok = torch.allclose(packed(x), want, rtol=tolerance, atol=tolerance * scale)
    except (RuntimeError, AttributeError):  # an op missing from this build of torch
        return None
    return packed if ok else None
