"""KIVI keys: codes per channel across a block (`ChannelFormat`); KIVI values are grouped per
token (grouped.py)."""
from __future__ import annotations

import torch

from kvserve.cache.formats.base import FieldSpec, Fields, KVFormat
from kvserve.cache.formats.codes import check_packable, dequantize_asym, pack, quantize_asym, unpack
from kvserve.cache.formats.layout import PageKind, PageLayout
from kvserve.validate import FieldError


class ChannelFormat(KVFormat):
    """KIVI keys: `bits`-bit asymmetric codes with one fp16 scale and zero-point per block, head and
    channel, taken over the block's tokens. Key outliers live in fixed channels, so a per-channel
    range isolates them where a per-token range would let them stretch every token's step.

    With `exact_sink`, each block's first key is stored in fp16 ("sink") and left out of the
    ranges (KVQuant keeps the first token in fp16 for the same reason): a sequence's first token
    draws attention from every query, so an error in its key moves every softmax, and its key
    is unlike the others, so it would stretch its block's ranges.

    With `wide` > 0, that many channels per KV head get one bit more (a third bit plane beside the
    packed codes): the channels whose error moves q.k most, chosen once by calibration
    (`calibrated`, see engine/kv_calibration.py). RoPE turns channels d and d + D/2 into each
    other with position, so they are chosen in pairs. Built uncalibrated (`wide_channels` None:
    its size is known, it cannot encode yet), as per-head fp8 scales are."""

    def __init__(self, name: str, bits: int, exact_sink: bool = False, wide: int = 0,
                 wide_channels: torch.Tensor | None = None) -> None:
        self.name, self.bits, self.exact_sink, self.wide = name, bits, exact_sink, wide
        self.wide_channels = wide_channels  # [num_kv_heads, wide] int64, ascending

    @property
    def layout(self) -> PageLayout:
        return PageLayout(PageKind.CHANNEL, per_token=False, bits=self.bits, exact_sink=self.exact_sink,
                          wide=self.wide, wide_channels=self.wide_channels)

    @property
    def calibrated_per_layer(self) -> bool:
        return self.wide > 0

    def calibrated(self, importance: torch.Tensor) -> "ChannelFormat":
        """This format with the `wide` channels of largest `importance` [H, D] per head, by RoPE pairs."""
        half = importance.shape[-1] // 2
        pairs = (importance[:, :half] + importance[:, half:]).topk(self.wide // 2, -1).indices
        chosen = torch.cat([pairs, pairs + half], -1).sort(-1).values
        return ChannelFormat(self.name, self.bits, self.exact_sink, self.wide, chosen.cpu())

    def _check(self, num_kv_heads: int, head_dim: int) -> None:
        check_packable(self.name, head_dim, self.bits)
        if self.wide > head_dim:
            raise FieldError("kv_key_wide_channels", f"kv_key_wide_channels {self.wide} exceeds head_dim {head_dim}")
        if self.wide_channels is not None and self.wide_channels.shape[0] != num_kv_heads:
            raise ValueError(f"{self.name}: calibrated for {self.wide_channels.shape[0]} KV heads, got {num_kv_heads}")

    def fields(self, num_kv_heads: int, head_dim: int, block_size: int) -> FieldSpec:
        self._check(num_kv_heads, head_dim)
        channels = (num_kv_heads, head_dim)
        spec = {"codes": ((block_size, num_kv_heads, head_dim * self.bits // 8), torch.uint8),
                "scale": (channels, torch.float16), "zero": (channels, torch.float16)}
        if self.wide:
            spec["wide"] = ((block_size, num_kv_heads, self.wide // 8), torch.uint8)
        return {**spec, "sink": (channels, torch.float16)} if self.exact_sink else spec

    def _wide_index(self, device: torch.device) -> torch.Tensor:
        if self.wide_channels is None:
            raise RuntimeError(f"{self.name} with kv_key_wide_channels: calibrate it before use (calibrated())")
        return self.wide_channels.to(device)

    def encode(self, x: torch.Tensor) -> Fields:
        self._check(x.shape[-2], x.shape[-1])
        include = None
        if self.exact_sink:
            include = (torch.arange(x.shape[-3], device=x.device) > 0)[:, None, None]
        codes, scale, zero = quantize_asym(x, self.bits, -3, include)  # -3: the block's token axis
        fields = {"codes": pack(codes, self.bits), "scale": scale, "zero": zero}
        if self.wide:
            index = self._wide_index(x.device)
            wide_x = x.gather(-1, index.expand(*x.shape[:-1], -1))
            wide_codes, wide_scale, wide_zero = quantize_asym(wide_x, self.bits + 1, -3, include)
            low = wide_codes & (2 ** self.bits - 1)
            fields = {"codes": pack(codes.scatter(-1, index.expand_as(low), low), self.bits),
                      "wide": pack(wide_codes >> self.bits, 1),
                      "scale": scale.scatter(-1, index.expand_as(wide_scale), wide_scale),
                      "zero": zero.scatter(-1, index.expand_as(wide_zero), wide_zero)}
        return {**fields, "sink": x[..., 0, :, :].to(torch.float16)} if self.exact_sink else fields

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        codes = unpack(fields["codes"], self.bits)
        if self.wide:
            top = unpack(fields["wide"], 1) << self.bits
            codes = codes.scatter_add(-1, self._wide_index(codes.device).expand_as(top), top)
        x = dequantize_asym(codes, fields["scale"], fields["zero"], -3)
        if self.exact_sink:
            x[..., 0, :, :] = fields["sink"].float()
        return x.to(dtype)
