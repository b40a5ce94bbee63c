"""How a kernel reads a page: the kind numbers shared by the C++ and Triton kernels.

DENSE: values as stored. ABSMAX: int8 / fp8 codes times one scale per token and head.
GROUPED: packed `bits`-bit codes with a scale and zero-point per `group` channels of each token
(int4, KIVI values). CHANNEL: packed codes with a scale and zero-point per block, head and
channel (KIVI keys). HEAD_ABSMAX: fp8 codes times one fixed fp32 scale per KV head
(`kv_fp8_scales="head"`), the scale held by the format, not the pages. GROUPED codes may be
symmetric (no zero-point) and CHANNEL codes may carry a bit plane for wide channels: a kernel
checks those attributes too. Formats with no kind (outlier, sparse) are decoded by the torch
backend.
"""
from __future__ import annotations

import torch

from kvserve.cache.kv_format import HeadScaleFormat, KVFormat

DENSE, ABSMAX, GROUPED, CHANNEL, HEAD_ABSMAX = 0, 1, 2, 3, 4
_ABSMAX_FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2")
_PLAIN_FORMATS = ("bf16", "fp16", "fp32")
_GROUPED_FORMATS = ("int4", "kivi2", "kivi4")


def page_kind(fmt: KVFormat) -> int | None:
    if isinstance(fmt, HeadScaleFormat):
        return HEAD_ABSMAX
    if fmt.name in _PLAIN_FORMATS:
        return DENSE
    if fmt.name in _ABSMAX_FORMATS:
        return ABSMAX
    if fmt.name in _GROUPED_FORMATS:
        return GROUPED if fmt.per_token else CHANNEL
    return None


def wide_slots(fmt: KVFormat, head_dim: int) -> torch.Tensor | None:
    """[kv_heads, D] int32 on the CPU: each channel's bit in a wide KIVI key's extra plane, -1 where
    it has none; None for a format without wide channels."""
    channels = getattr(fmt, "wide_channels", None)
    if channels is None:
        return None
    slots = torch.full((channels.shape[0], head_dim), -1, dtype=torch.int32)
    bit = torch.arange(channels.shape[1], dtype=torch.int32).expand_as(channels).contiguous()
    return slots.scatter_(1, channels, bit)
