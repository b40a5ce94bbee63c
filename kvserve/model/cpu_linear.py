"""Linear layers with weights prepacked for oneDNN, for bf16/fp16 inference on CPU.

A plain bf16 `F.linear` on CPU reformats the weight on every call; packing it once at load
time makes the projections of a decode step about 1.5x faster (see BENCHMARKS.md).
"""
from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.out_features = linear.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()),
                             persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
            and torch.backends.mkldnn.is_available())


def pack_linears(model: nn.Module) -> None:
    """Swaps every nn.Linear in `model` for a PackedLinear, in place."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, PackedLinear(child))
        else:
            pack_linears(child)
