"""KIVI keys: codes per channel across a block (`ChannelFormat`, and `MixedChannelFormat` with bits per
channel); KIVI values are grouped per token (grouped.py)."""
from __future__ import annotations

import torch

from kvserve.cache.formats.base import FieldSpec, Fields, KVFormat
from kvserve.cache.formats.codes import check_packable, dequantize_asym, pack, quantize_asym, unpack
from kvserve.cache.formats.layout import PageKind, PageLayout
from kvserve.validate import FieldError


def _range_tokens(x: torch.Tensor, exact_sink: bool) -> torch.Tensor | None:
    """The tokens of a block x [..., T, H, D] that set its channel ranges: with an exact sink, all
    but the first (stored apart in fp16); None: all."""
    return (torch.arange(x.shape[-3], device=x.device) > 0)[:, None, None] if exact_sink else None


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
        include = _range_tokens(x, self.exact_sink)
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


def bit_choices(bits: int) -> tuple[int, ...]:
    """The bits a channel of a `bits`-bit MixedChannelFormat may take: 0, or 2 up to twice `bits`.
    0 bits decode the block's mean, about what one bit of min-max codes costs, so one bit is never
    chosen and 0 is."""
    return (0, *range(2, 2 * bits + 1))


def allocate_bits(importance: torch.Tensor, total: int, choices: tuple[int, ...] = bit_choices(2)) -> torch.Tensor:
    """importance [H, D] (E[q_d^2] E[range_d^2]) -> bits per channel [H, D] in `choices`, equal
    within each RoPE pair (d, d + D/2: RoPE turns them into each other), at most `total` bits per
    head, chosen to minimise sum_d importance_d / (2^b_d - 1)^2 (the q.k error of uniform codes on a
    channel's block range, relative to range^2 / 12; 0 bits cost 1). Greedy in the cost saved per bit
    over each pair's next choice: the costs are convex in bits once 1 is skipped, so the greedy
    order is the Lagrangian one."""
    heads, dim = importance.shape
    half = dim // 2
    pairs = (importance[:, :half] + importance[:, half:]).double()
    pairs = (pairs / pairs.sum(-1, keepdim=True).clamp_min(1e-30)).tolist()
    cost = [1.0 if b == 0 else 1.0 / (2 ** b - 1) ** 2 for b in choices]
    bits = torch.zeros(heads, half, dtype=torch.int64)
    for h in range(heads):
        used, level = 0, [0] * half  # index into choices per pair
        while True:
            best, best_gain = -1, 0.0
            for p in range(half):
                i = level[p]
                if i + 1 < len(choices) and used + 2 * (choices[i + 1] - choices[i]) <= total:
                    gain = pairs[h][p] * (cost[i] - cost[i + 1]) / (choices[i + 1] - choices[i])
                    if gain > best_gain:
                        best, best_gain = p, gain
            if best < 0:
                break
            used += 2 * (choices[level[best] + 1] - choices[level[best]])
            level[best] += 1
        bits[h] = torch.tensor([choices[i] for i in level])
    return torch.cat([bits, bits], -1)


class MixedChannelFormat(KVFormat):
    """KIVI keys at `bits * D + wide` bits per token and head (what ChannelFormat's `bits`-bit codes
    with `wide` wide channels cost), spent by calibration: each RoPE pair of channels gets 0, or 2 up
    to 2 x `bits` bits, by its importance (`allocate_bits`). On Gemma 3 a head's top 48 of 128 pairs
    hold 80-95% of E[q_d^2] E[range_d^2], so the bottom ones are worth less than the base bits and
    the top ones more: at 2.5 bits on Gemma 3 this (with the exact sink's bits spent on channels too)
    halves the kivi2 layout's KL (0.049-0.054 against 0.093-0.105); at 4.5 bits it takes kivi4's
    from 0.018-0.023 to 0.0043-0.0056, at the same bytes (BENCHMARKS.md, issue 42). Codes per
    channel are min-max asymmetric over the block's tokens as ChannelFormat's; a 0-bit channel
    decodes as its block mean (its zero-point field). Codes are stored as bit planes in one packed
    field: the flat bit string holds, for each plane j, bit j of every channel with more than j
    bits; calibration fixes that order (`_slot_order`). No kernel reads these pages (layout kind
    None): the torch backend decodes them."""

    def __init__(self, name: str, bits: int, exact_sink: bool = False, wide: int = 0,
                 channel_bits: torch.Tensor | None = None) -> None:
        self.name, self.bits, self.exact_sink, self.wide = name, bits, exact_sink, wide
        # [num_kv_heads, D] int64. Uncalibrated (None), every channel takes `bits`, so that a format
        # read from a name alone still round-trips (as fitted.py's do) at kivi's bits.
        self.channel_bits = channel_bits
        self._slot_table = None if channel_bits is None else self._slot_order(channel_bits, bits, wide)

    @property
    def layout(self) -> PageLayout:
        # `wide`: the bits per head beyond `bits` a channel (kv_key_wide_channels), as ChannelFormat's.
        return PageLayout(None, per_token=False, bits=self.bits, exact_sink=self.exact_sink, wide=self.wide)

    @property
    def calibrated_per_layer(self) -> bool:
        return True

    def calibrated(self, importance: torch.Tensor) -> "MixedChannelFormat":
        return MixedChannelFormat(self.name, self.bits, self.exact_sink, self.wide, self.allocated(importance))

    def allocated(self, importance: torch.Tensor) -> torch.Tensor:
        """Bits per channel [H, D] that `importance` [H, D] buys within this format's key bits."""
        return allocate_bits(importance.float().cpu(), self.bits * importance.shape[-1] + self.wide,
                             bit_choices(self.bits))

    def fields(self, num_kv_heads: int, head_dim: int, block_size: int) -> FieldSpec:
        if self.wide > self.bits * head_dim:
            raise FieldError("kv_key_wide_channels", f"kv_key_wide_channels {self.wide} exceeds {self.bits} x "
                             f"head_dim {head_dim} ({2 * self.bits}-bit keys)")
        if self.channel_bits is not None and self.channel_bits.shape != (num_kv_heads, head_dim):
            raise ValueError(f"{self.name}: calibrated for {tuple(self.channel_bits.shape)} (KV heads, head_dim), "
                             f"got {(num_kv_heads, head_dim)}")
        channels = (num_kv_heads, head_dim)
        spec = {"codes": ((block_size, num_kv_heads, (self.bits * head_dim + self.wide) // 8), torch.uint8),
                "scale": (channels, torch.float16), "zero": (channels, torch.float16)}
        return {**spec, "sink": (channels, torch.float16)} if self.exact_sink else spec

    def _bits(self, heads: int, dim: int) -> torch.Tensor:
        if self.channel_bits is None:
            return torch.full((heads, dim), self.bits, dtype=torch.int64)
        return self.channel_bits

    def _slots(self, heads: int, dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        table = self._slot_table or self._slot_order(self._bits(heads, dim), self.bits, self.wide)
        channel, plane, used = table
        return channel.to(device), plane.to(device), used.to(device)

    @staticmethod
    def _slot_order(channel_bits: torch.Tensor, bits: int, wide: int,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The flat bit string's (channel, plane, used) per slot [H, S]; unused slots are padding.
        Built once at calibration: every decode reads it."""
        heads, dim = channel_bits.shape
        size = bits * dim + wide
        channel = torch.zeros(heads, size, dtype=torch.int64)
        plane = torch.zeros(heads, size, dtype=torch.int64)
        used = torch.zeros(heads, size, dtype=torch.bool)
        for h in range(heads):
            planes = range(int(channel_bits[h].max()))
            chans = [c for j in planes for c in (channel_bits[h] > j).nonzero().flatten().tolist()]
            plane_of = [j for j in planes for _ in range(int((channel_bits[h] > j).sum()))]
            channel[h, :len(chans)] = torch.tensor(chans, dtype=torch.int64)
            plane[h, :len(plane_of)] = torch.tensor(plane_of, dtype=torch.int64)
            used[h, :len(chans)] = True
        return channel, plane, used

    def encode(self, x: torch.Tensor) -> Fields:
        x = x.float()
        heads, dim = x.shape[-2:]
        bits = self._bits(heads, dim).to(x.device)
        channel, plane, used = self._slots(heads, dim, x.device)
        codes, scale, zero = quantize_asym(x, bits, -3, _range_tokens(x, self.exact_sink))
        # 0-bit channels keep the block's mean in the zero-point; their code is 0.
        body = x[..., 1:, :, :] if self.exact_sink else x
        zero = torch.where(bits == 0, body.mean(-3).to(torch.float16), zero)
        flat = codes.to(torch.int64).gather(-1, channel.expand(*codes.shape[:-1], -1)) >> plane
        flat = (flat & 1).masked_fill(~used, 0).to(torch.uint8)
        fields = {"codes": pack(flat, 1), "scale": scale, "zero": zero}
        return {**fields, "sink": x[..., 0, :, :].to(torch.float16)} if self.exact_sink else fields

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        flat = unpack(fields["codes"], 1).to(torch.int64)
        heads, dim = fields["scale"].shape[-2:]
        channel, plane, used = self._slots(heads, dim, flat.device)
        top = (flat << plane).masked_fill(~used, 0)
        codes = torch.zeros(*flat.shape[:-1], dim, dtype=torch.int64, device=flat.device)
        codes = codes.scatter_add(-1, channel.expand_as(top), top)
        x = dequantize_asym(codes, fields["scale"], fields["zero"], -3)
        if self.exact_sink:
            x[..., 0, :, :] = fields["sink"].float()
        return x.to(dtype)
