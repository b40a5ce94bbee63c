"""What the kernels need of a format beyond its pages, read from its `PageLayout` (the kind numbers
themselves are `PageKind`'s, shared by the C++ and Triton kernels).

A format whose layout has no kind is decoded by the torch backend alone. GROUPED codes may be
symmetric (no zero-point) and CHANNEL codes may carry a bit plane for wide channels: a kernel
reads those from the layout too.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from kvserve.cache.formats import KVFormat, PageLayout


def kernel_unsupported(formats: Iterable[KVFormat]) -> list[str]:
    """The names of `formats` whose pages no kernel reads, sorted, once each."""
    return sorted({f.name for f in formats if f.layout.kind is None})


def fitted_names(formats: Iterable[KVFormat]) -> list[str]:
    """The names of `formats` whose pages are fitted codes (`PageLayout.fitted`), sorted, once each."""
    return sorted({f.name for f in formats if f.layout.fitted})


def wide_slots(layout: PageLayout, head_dim: int) -> torch.Tensor | None:
    """[kv_heads, D] int32 on the CPU: each channel's bit in a wide KIVI key's extra plane, -1 where
    it has none; None for a layout without calibrated wide channels."""
    channels = layout.wide_channels
    if channels is None:
        return None
    slots = torch.full((channels.shape[0], head_dim), -1, dtype=torch.int32)
    bit = torch.arange(channels.shape[1], dtype=torch.int32).expand_as(channels).contiguous()
    return slots.scatter_(1, channels, bit)
