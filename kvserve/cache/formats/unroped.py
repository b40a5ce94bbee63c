"""kivi2_mix_unrope: kivi2_mix's keys coded turned back by their offset in the block
(`UnropedChannelFormat`, block_rope.py), and with `kv_exact_sink` each block's first key *and* first
value kept in int8 (`SinkValueFormat` for the values).

Why each part (BENCHMARKS.md, issue 42, 2.5 bits a value): turned back, a fast RoPE pair no longer
swings through its whole range within a block, and the keys' KL falls by about a third on SmolLM2
and a fifth on Gemma 3. Once the keys lose less, the 2-bit values are most of what is left, and of
their error the sequence's first token's counts most: it draws much of every query's attention,
so its value's error passes into the output nearly whole where other tokens' errors average out.
Keeping it costs a block 8 bits a channel in int8 (half of kivi's fp16 sink, near the same gain)
plus an fp16 scale that lives where the block's first token would keep its own codes, which
decoding never reads: so the sinks of keys and values together cost what kivi's key sink alone
costs, 16 / block_size bits a value.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from kvserve.cache.formats.absmax import AbsMaxFormat
from kvserve.cache.formats.base import FieldSpec, Fields, KVFormat
from kvserve.cache.formats.block_rope import BlockRope
from kvserve.cache.formats.grouped import GroupFormat
from kvserve.cache.formats.kivi import MixedChannelFormat
from kvserve.cache.formats.layout import PageLayout
from kvserve.cache.formats.vector import VectorFormat

# A sink: int8 codes and one fp16 scale per head (the scale stored in the first token's own slot).
_SINK = AbsMaxFormat("sink", torch.int8)
_SCALE_BYTES = 2  # an fp16 scale, as the first token's code bytes carry a key sink's


class UnropedChannelFormat(MixedChannelFormat):
    """MixedChannelFormat's codes and bits per channel, on keys turned back by their offset in the
    block; the bits are spent by importance measured on keys so turned. Calibration hands it the
    layer's RoPE angles (`rope`); uncalibrated it codes keys as they come, as MixedChannelFormat
    does with no bits chosen. With `exact_sink`, the block's first key is int8 codes (field "sink")
    with its fp16 scale in the first two bytes of that token's codes."""

    def __init__(self, name: str, bits: int, exact_sink: bool = False, wide: int = 0,
                 channel_bits: torch.Tensor | None = None, rope: BlockRope | None = None) -> None:
        super().__init__(name, bits, exact_sink, wide, channel_bits)
        self.rope = rope

    @property
    def reads_rope_pairs(self) -> bool:
        return True

    def calibrated(self, importance: torch.Tensor, rope: BlockRope | None = None) -> "UnropedChannelFormat":
        """This format with its bits spent by `importance` [H, D] of keys turned back by `rope`, the
        layer's angles (required: the engine's calibration passes them)."""
        if rope is None:
            raise ValueError(f"{self.name}: calibrated without the layer's RoPE angles")
        return UnropedChannelFormat(self.name, self.bits, self.exact_sink, self.wide, self.allocated(importance), rope)

    def fields(self, num_kv_heads: int, head_dim: int, block_size: int) -> FieldSpec:
        spec = super().fields(num_kv_heads, head_dim, block_size)
        if self.exact_sink:
            if spec["codes"][0][-1] < _SCALE_BYTES:
                raise ValueError(f"{self.name}: a token's codes ({spec['codes'][0][-1]} bytes) cannot carry "
                                 "its sink's scale")
            spec["sink"] = ((num_kv_heads, head_dim), torch.int8)
        return spec

    def encode(self, x: torch.Tensor) -> Fields:
        x = x.float() if self.rope is None else self.rope.unrotate(x)
        fields = super().encode(x)
        if self.exact_sink:
            sink = _SINK.encode(x[..., 0, :, :])
            fields["codes"][..., 0, :, :_SCALE_BYTES] = sink["scale"].unsqueeze(-1).view(torch.uint8)
            fields["sink"] = sink["codes"]
        return fields

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        x = super().decode(fields, torch.float32)
        if self.exact_sink:
            scale = fields["codes"][..., 0, :, :_SCALE_BYTES].contiguous().view(torch.float16).squeeze(-1)
            x[..., 0, :, :] = _SINK.decode({"codes": fields["sink"], "scale": scale}, torch.float32)
        return (x if self.rope is None else self.rope.rotate(x)).to(dtype)


class SinkValueFormat(KVFormat):
    """A per-token value format's codes (`GroupFormat`'s or `VectorFormat`'s) for every token of a
    block, and the block's first value also in int8 (field "sink"), its fp16 scale in that token's
    first scale slot, which decoding puts in its place. Encoded a block at a time (the sink is per
    block), so it is staged as KIVI keys are."""

    def __init__(self, codes: GroupFormat | VectorFormat) -> None:
        self.codes = codes
        self.name = codes.name

    @property
    def layout(self) -> PageLayout:
        return replace(self.codes.layout, kind=None, per_token=False, exact_sink=True)

    def fields(self, num_kv_heads: int, head_dim: int, block_size: int) -> FieldSpec:
        return {**self.codes.fields(num_kv_heads, head_dim, block_size),
                "sink": ((num_kv_heads, head_dim), torch.int8)}

    def encode(self, x: torch.Tensor) -> Fields:
        fields = self.codes.encode(x)
        sink = _SINK.encode(x[..., 0, :, :])
        fields["scale"][..., 0, :, 0] = sink["scale"]
        return {**fields, "sink": sink["codes"]}

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        x = self.codes.decode({name: t for name, t in fields.items() if name != "sink"}, torch.float32)
        x[..., 0, :, :] = _SINK.decode({"codes": fields["sink"], "scale": fields["scale"][..., 0, :, 0]},
                                       torch.float32)
        return x.to(dtype)
