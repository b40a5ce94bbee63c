"""Storage formats for the KV cache: how one block of K or V is laid out, encoded and decoded.

Every format is pure torch on whatever device its inputs live on. Encoding and decoding work in
fp32 whatever the input dtype. Scales and zero-points are stored in fp16 and chosen *after* fp16
rounding, so the per-entry error bounds documented below hold against the stored values, not
against some fp32 value the decoder never sees. Inputs must lie within fp16 range (|x| < 65504),
since zero-points and outliers are stored in fp16.

`make_format` builds a format by name; a format for keys may differ from the one for values
(KIVI quantizes keys per channel across a block and values per token).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from kvserve.validate import is_int

FieldSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]
Fields = dict[str, torch.Tensor]

FORMAT_NAMES: tuple[str, ...] = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8", "int4",
                                 "kivi2", "kivi4", "outlier", "sparse")
FP8_SCALES: tuple[str, ...] = ("token", "head")

# Smallest scale ever stored: fp16's smallest normal number. A smaller one (1e-6, say) would still
# be representable, but as a subnormal: with a fixed step of 2^-24 it keeps few significant bits,
# rounding it up to cover the range inflates it by up to 2x near the bottom, and its reciprocal
# (1e6) overflows fp16 in a kernel that divides in half precision; 1 / 2^-14 = 16384 does not.
# The cost, a step of at least 6.1e-5 for a token or group whose whole range is smaller than
# qmax times that, is far below anything attention can notice.
MIN_SCALE = 2.0 ** -14


def _fp16_rounded(x: torch.Tensor, up: bool) -> torch.Tensor:
    """x (fp32) in fp16, rounded toward +inf (up) or -inf instead of to nearest."""
    h = x.to(torch.float16)
    wrong_side = h.float() < x if up else h.float() > x
    toward = torch.full_like(h, math.inf if up else -math.inf)
    return torch.where(wrong_side, torch.nextafter(h, toward), h)


def _quantize_asym(x: torch.Tensor, bits: int, dim: int, include: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric `bits`-bit codes (uint8, unpacked) with one fp16 scale and zero-point per slice
    reduced along `dim`; decoding is code * scale + zero, within scale / 2 of x. Only entries where
    `include` is True set the range; the others are clamped (their caller stores them elsewhere)."""
    qmax = 2 ** bits - 1
    x = x.float()
    if include is None:
        lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    else:
        lo = x.masked_fill(~include, math.inf).amin(dim, keepdim=True)
        hi = x.masked_fill(~include, -math.inf).amax(dim, keepdim=True)
        empty = lo > hi  # every entry excluded: any range will do, but not an infinite one
        lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    # Zero rounds down and the scale is sized from it, rounding up, so the grid still spans
    # [lo, hi] after both are rounded to fp16 and no code has to be clamped.
    zero = _fp16_rounded(lo, up=False)
    scale = _fp16_rounded(((hi - zero.float()) / qmax).clamp_min(MIN_SCALE), up=True)
    codes = ((x - zero.float()) / scale.float()).round().clamp(0, qmax).to(torch.uint8)
    return codes, scale.squeeze(dim), zero.squeeze(dim)


def _dequantize_asym(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                     dim: int) -> torch.Tensor:
    return codes.float() * scale.float().unsqueeze(dim) + zero.float().unsqueeze(dim)


def _quantize_midrise(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric `bits`-bit codes with no zero-point: code c (uint8) decodes as (c - 2^(b-1) + 1/2) *
    scale, levels placed evenly about zero with none *at* zero, so all 2^b of them are used (an
    absmax grid with a zero level wastes one). One fp16 scale per slice along `dim`, rounded up so
    that the largest |x| is within the outermost level: decoding is within scale / 2 of x."""
    half = 2 ** (bits - 1)
    x = x.float()
    scale = _fp16_rounded((x.abs().amax(dim, keepdim=True) / (half - 0.5)).clamp_min(MIN_SCALE), up=True)
    codes = (x / scale.float() - 0.5).round().clamp(-half, half - 1) + half
    return codes.to(torch.uint8), scale.squeeze(dim)


def _dequantize_midrise(codes: torch.Tensor, scale: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    return (codes.float() - (2 ** (bits - 1) - 0.5)) * scale.float().unsqueeze(dim)


def _bit_shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes < 2**bits, last dim L -> uint8 [..., L * bits / 8], first code in the low bits."""
    shifts = _bit_shifts(bits, codes.device)
    grouped = codes.unflatten(-1, (-1, len(shifts)))
    # The codes occupy disjoint bits, so their sum is their bitwise or.
    return (grouped << shifts).sum(-1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    shifts = _bit_shifts(bits, packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & (2 ** bits - 1)).flatten(-2)


def _check_packable(name: str, head_dim: int, bits: int) -> None:
    if head_dim % (8 // bits):
        raise ValueError(f"{name}: head_dim {head_dim} must be a multiple of {8 // bits} to pack its codes")


def _check_index_range(name: str, head_dim: int) -> None:
    if head_dim > 256:
        raise ValueError(f"{name}: head_dim {head_dim} does not fit its uint8 channel indices (max 256)")


class KVFormat(ABC):
    name: str
    per_token: bool  # False: encoded a whole block at a time

    @abstractmethod
    def fields(self, num_kv_heads: int, head_dim: int, block_size: int) -> FieldSpec:
        """Storage of one block: field name -> (shape, dtype). For per-token formats every shape
        starts with (block_size, num_kv_heads), so a pool can address token slots through
        `tensor.view(-1, *shape[1:])`."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> Fields:
        """per_token: x [N, H, D] -> fields [N, *shape[1:]]; block formats: x [B, bs, H, D] ->
        fields [B, *shape]."""

    @abstractmethod
    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        """Fields with any leading dims -> [..., bs, H, D] (or [..., H, D]) in `dtype`."""

    def bytes_per_token(self, num_kv_heads: int, head_dim: int, block_size: int) -> float:
        spec = self.fields(num_kv_heads, head_dim, block_size)
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in spec.values()) / block_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class _PerTokenFormat(KVFormat):
    """A format that encodes each token (and head) on its own: encode and decode are elementwise
    over every dim before the last two, so they commute with slicing and scattering tokens."""
    per_token = True

    @abstractmethod
    def token_fields(self, num_kv_heads: int, head_dim: int) -> FieldSpec:
        """Storage of one token, shapes starting with num_kv_heads."""

    def fields(self, num_kv_heads: int, head_dim: int, block_size: int) -> FieldSpec:
        return {key: ((block_size, *shape), dtype)
                for key, (shape, dtype) in self.token_fields(num_kv_heads, head_dim).items()}


class _PlainFormat(_PerTokenFormat):
    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype

    def token_fields(self, num_kv_heads: int, head_dim: int) -> FieldSpec:
        return {"data": ((num_kv_heads, head_dim), self.dtype)}

    def encode(self, x: torch.Tensor) -> Fields:
        return {"data": x.to(self.dtype)}

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        return fields["data"].to(dtype)


class _AbsMaxFormat(_PerTokenFormat):
    """Symmetric codes (int8 or fp8) with one fp16 scale per token and head: scale = amax / the
    code's max, rounded up so the largest entry never leaves the code's range (fp8 e4m3 has no
    infinity: an overflow would become NaN)."""

    def __init__(self, name: str, code_dtype: torch.dtype) -> None:
        self.name, self.code_dtype = name, code_dtype
        self.is_float = code_dtype.is_floating_point
        # int8 drops -128 so that the range is symmetric and -x encodes as -code.
        self.qmax = torch.finfo(code_dtype).max if self.is_float else torch.iinfo(code_dtype).max

    def token_fields(self, num_kv_heads: int, head_dim: int) -> FieldSpec:
        return {"codes": ((num_kv_heads, head_dim), self.code_dtype),
                "scale": ((num_kv_heads,), torch.float16)}

    def encode(self, x: torch.Tensor) -> Fields:
        x = x.float()
        scale = _fp16_rounded((x.abs().amax(-1) / self.qmax).clamp_min(MIN_SCALE), up=True)
        y = (x / scale.float().unsqueeze(-1)).clamp(-self.qmax, self.qmax)
        if not self.is_float:  # float8 casts round to nearest; integer casts would truncate
            y = y.round()
        return {"codes": y.to(self.code_dtype), "scale": scale}

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        return (fields["codes"].float() * fields["scale"].float().unsqueeze(-1)).to(dtype)


class HeadScaleFormat(_PerTokenFormat):
    """fp8 codes with one fixed fp32 scale per KV head, calibrated once (vLLM's per-head scales):
    no scale is computed or stored per token, so a page is its codes alone. An entry beyond the
    calibrated range saturates at the code's max. Built uncalibrated (`head_scale` None: its
    size is known, it cannot encode yet); `calibrated` gives the format that can."""

    def __init__(self, name: str, code_dtype: torch.dtype, head_scale: torch.Tensor | None = None) -> None:
        self.name, self.code_dtype = name, code_dtype
        self.qmax = torch.finfo(code_dtype).max
        self.head_scale = None if head_scale is None else head_scale.float()  # [num_kv_heads]

    def calibrated(self, amax: torch.Tensor) -> "HeadScaleFormat":
        """This format with scales that map each head's calibrated |x| max, `amax` [H], to the code's max."""
        return HeadScaleFormat(self.name, self.code_dtype, (amax.float() / self.qmax).clamp_min(MIN_SCALE))

    def _scale(self, device: torch.device) -> torch.Tensor:
        if self.head_scale is None:
            raise RuntimeError(f"{self.name} with per-head scales: calibrate it before use (calibrated())")
        return self.head_scale.to(device).unsqueeze(-1)

    def token_fields(self, num_kv_heads: int, head_dim: int) -> FieldSpec:
        if self.head_scale is not None and num_kv_heads != len(self.head_scale):
            raise ValueError(f"{self.name}: calibrated for {len(self.head_scale)} KV heads, got {num_kv_heads}")
        return {"codes": ((num_kv_heads, head_dim), self.code_dtype)}

    def encode(self, x: torch.Tensor) -> Fields:
        y = x.float() / self._scale(x.device)
        return {"codes": y.clamp(-self.qmax, self.qmax).to(self.code_dtype)}

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        codes = fields["codes"]
        return (codes.float() * self._scale(codes.device)).to(dtype)


class _GroupFormat(_PerTokenFormat):
    """Asymmetric `bits`-bit codes, one fp16 scale and zero-point per `group_size` consecutive
    channels of each token and head; codes packed 8 / bits per byte. `symmetric`: midrise codes
    with a scale alone (16 bits per group fewer), for values centred on zero, as rotated ones are."""

    def __init__(self, name: str, bits: int, group_size: int, symmetric: bool = False) -> None:
        self.name, self.bits, self.group_size, self.symmetric = name, bits, group_size, symmetric

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % self.group_size:
            raise ValueError(f"kv_group_size {self.group_size} must divide head_dim {head_dim}")
        _check_packable(self.name, head_dim, self.bits)

    def token_fields(self, num_kv_heads: int, head_dim: int) -> FieldSpec:
        self.check_head_dim(head_dim)
        groups = (num_kv_heads, head_dim // self.group_size)
        spec = {"codes": ((num_kv_heads, head_dim * self.bits // 8), torch.uint8), "scale": (groups, torch.float16)}
        return spec if self.symmetric else {**spec, "zero": (groups, torch.float16)}

    def quantize(self, x: torch.Tensor, include: torch.Tensor | None = None) -> Fields:
        self.check_head_dim(x.shape[-1])
        grouped = x.unflatten(-1, (-1, self.group_size))
        if self.symmetric:
            codes, scale = _quantize_midrise(grouped, self.bits, -1)
            return {"codes": _pack(codes.flatten(-2), self.bits), "scale": scale}
        if include is not None:
            include = include.unflatten(-1, (-1, self.group_size))
        codes, scale, zero = _quantize_asym(grouped, self.bits, -1, include)
        return {"codes": _pack(codes.flatten(-2), self.bits), "scale": scale, "zero": zero}

    def dequantize(self, fields: Fields) -> torch.Tensor:
        codes = _unpack(fields["codes"], self.bits).unflatten(-1, (-1, self.group_size))
        if self.symmetric:
            return _dequantize_midrise(codes, fields["scale"], self.bits, -1).flatten(-2)
        return _dequantize_asym(codes, fields["scale"], fields["zero"], -1).flatten(-2)

    def encode(self, x: torch.Tensor) -> Fields:
        return self.quantize(x)

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantize(fields).to(dtype)


class _OutlierFormat(_GroupFormat):
    """int4 group-wise, except that each token-head's `outliers` largest-magnitude entries are kept
    exactly (fp16 value + uint8 channel) and left out of their group's range, so one huge channel
    does not coarsen the step of its whole group."""

    def __init__(self, group_size: int, outliers: int) -> None:
        super().__init__("outlier", 4, group_size)
        self.outliers = outliers

    def check_head_dim(self, head_dim: int) -> None:
        super().check_head_dim(head_dim)
        _check_index_range(self.name, head_dim)
        if self.outliers > head_dim:
            raise ValueError(f"kv_outliers {self.outliers} exceeds head_dim {head_dim}")

    def token_fields(self, num_kv_heads: int, head_dim: int) -> FieldSpec:
        side = (num_kv_heads, self.outliers)
        return {**super().token_fields(num_kv_heads, head_dim),
                "outlier_val": (side, torch.float16), "outlier_idx": (side, torch.uint8)}

    def encode(self, x: torch.Tensor) -> Fields:
        x = x.float()
        idx = x.abs().topk(self.outliers, dim=-1).indices
        include = torch.ones_like(x, dtype=torch.bool).scatter(-1, idx, False)
        return {**self.quantize(x, include),
                "outlier_val": x.gather(-1, idx).to(torch.float16), "outlier_idx": idx.to(torch.uint8)}

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        x = self.dequantize(fields)
        x = x.scatter(-1, fields["outlier_idx"].long(), fields["outlier_val"].float())
        return x.to(dtype)


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
    per_token = False

    def __init__(self, name: str, bits: int, exact_sink: bool = False, wide: int = 0,
                 wide_channels: torch.Tensor | None = None) -> None:
        self.name, self.bits, self.exact_sink, self.wide = name, bits, exact_sink, wide
        self.wide_channels = wide_channels  # [num_kv_heads, wide] int64, ascending

    def calibrated(self, importance: torch.Tensor) -> "ChannelFormat":
        """This format with the `wide` channels of largest `importance` [H, D] per head, by RoPE pairs."""
        half = importance.shape[-1] // 2
        pairs = (importance[:, :half] + importance[:, half:]).topk(self.wide // 2, -1).indices
        chosen = torch.cat([pairs, pairs + half], -1).sort(-1).values
        return ChannelFormat(self.name, self.bits, self.exact_sink, self.wide, chosen.cpu())

    def _check(self, num_kv_heads: int, head_dim: int) -> None:
        _check_packable(self.name, head_dim, self.bits)
        if self.wide > head_dim:
            raise ValueError(f"kv_key_wide_channels {self.wide} exceeds head_dim {head_dim}")
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
        codes, scale, zero = _quantize_asym(x, self.bits, -3, include)  # -3: the block's token axis
        fields = {"codes": _pack(codes, self.bits), "scale": scale, "zero": zero}
        if self.wide:
            index = self._wide_index(x.device)
            wide_x = x.gather(-1, index.expand(*x.shape[:-1], -1))
            wide_codes, wide_scale, wide_zero = _quantize_asym(wide_x, self.bits + 1, -3, include)
            low = wide_codes & (2 ** self.bits - 1)
            fields = {"codes": _pack(codes.scatter(-1, index.expand_as(low), low), self.bits),
                      "wide": _pack(wide_codes >> self.bits, 1),
                      "scale": scale.scatter(-1, index.expand_as(wide_scale), wide_scale),
                      "zero": zero.scatter(-1, index.expand_as(wide_zero), wide_zero)}
        return {**fields, "sink": x[..., 0, :, :].to(torch.float16)} if self.exact_sink else fields

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        codes = _unpack(fields["codes"], self.bits)
        if self.wide:
            top = _unpack(fields["wide"], 1) << self.bits
            codes = codes.scatter_add(-1, self._wide_index(codes.device).expand_as(top), top)
        x = _dequantize_asym(codes, fields["scale"], fields["zero"], -3)
        if self.exact_sink:
            x[..., 0, :, :] = fields["sink"].float()
        return x.to(dtype)


class _SparseFormat(_PerTokenFormat):
    """Per token and head, up to `capacity` entries as fp16 value + uint8 channel: the largest in
    magnitude, of those only the ones with |x| >= threshold * rms(x); everything else decodes as 0.
    A dropped slot stores value 0 (its index is then irrelevant).

    The stored fields do not determine head_dim (ceil(capacity * head_dim) is not invertible), so
    the format binds to the head_dim it first sees in `fields` or `encode`, as a cache's does."""
    name = "sparse"

    def __init__(self, threshold: float, capacity: float) -> None:
        self.threshold, self.capacity = threshold, capacity
        self.head_dim: int | None = None

    def slots(self, head_dim: int) -> int:
        _check_index_range(self.name, head_dim)
        if self.head_dim not in (None, head_dim):
            raise ValueError(f"sparse format is bound to head_dim {self.head_dim}, got {head_dim}")
        self.head_dim = head_dim
        return math.ceil(self.capacity * head_dim)

    def token_fields(self, num_kv_heads: int, head_dim: int) -> FieldSpec:
        kept = (num_kv_heads, self.slots(head_dim))
        return {"val": (kept, torch.float16), "idx": (kept, torch.uint8)}

    def encode(self, x: torch.Tensor) -> Fields:
        x = x.float()
        top = x.abs().topk(self.slots(x.shape[-1]), dim=-1)
        rms = x.square().mean(-1, keepdim=True).sqrt()
        val = x.gather(-1, top.indices).masked_fill(top.values < self.threshold * rms, 0.0)
        return {"val": val.to(torch.float16), "idx": top.indices.to(torch.uint8)}

    def bound_head_dim(self) -> int:
        if self.head_dim is None:
            raise RuntimeError("sparse format: call fields() or encode() before decoding")
        return self.head_dim

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        val, idx = fields["val"], fields["idx"]
        out = torch.zeros((*val.shape[:-1], self.bound_head_dim()), dtype=torch.float32, device=val.device)
        return out.scatter(-1, idx.long(), val.float()).to(dtype)

    def kept_fraction(self, fields: Fields) -> float:
        """Fraction of all entries (tokens x heads x channels) that were kept."""
        val = fields["val"]
        entries = val.numel() // val.shape[-1] * self.bound_head_dim()
        return torch.count_nonzero(val).item() / entries


def check_format_options(group_size: int, outliers: int, sparse_threshold: float, sparse_capacity: float,
                         fp8_scales: str, key_wide_channels: int) -> None:
    """The format settings' own ranges, named as the engine's fields (EngineConfig checks them too,
    whatever its formats)."""
    if not (is_int(group_size) and 4 <= group_size <= 128):
        raise ValueError("kv_group_size must be an integer from 4 to 128 that divides head_dim, "
                         f"got {group_size!r}")
    if not (is_int(outliers) and outliers >= 1):
        raise ValueError(f"kv_outliers must be an integer >= 1, got {outliers!r}")
    if not (isinstance(sparse_threshold, (int, float)) and sparse_threshold >= 0):
        raise ValueError(f"kv_sparse_threshold must be >= 0, got {sparse_threshold!r}")
    if not (isinstance(sparse_capacity, (int, float)) and 0 < sparse_capacity <= 1):
        raise ValueError(f"kv_sparse_capacity must be in (0, 1], got {sparse_capacity!r}")
    if fp8_scales not in FP8_SCALES:
        raise ValueError(f"kv_fp8_scales must be one of {', '.join(FP8_SCALES)}, got {fp8_scales!r}")
    if not (is_int(key_wide_channels) and key_wide_channels >= 0 and key_wide_channels % 8 == 0):
        raise ValueError("kv_key_wide_channels must be a multiple of 8 (whole bytes of its bit plane, whole RoPE "
                         f"pairs), got {key_wide_channels!r}")


def make_format(name: str, role: str, *, group_size: int = 32, outliers: int = 4,
                sparse_threshold: float = 0.5, sparse_capacity: float = 0.5, fp8_scales: str = "token",
                exact_sink: bool = False, key_wide_channels: int = 0, symmetric_values: bool = False) -> KVFormat:
    """The format called `name` for keys (role "k") or values (role "v"); `fp8_scales` "head"
    gives fp8 formats one calibrated scale per KV head (uncalibrated until `calibrated`) instead
    of a dynamic one per token; `exact_sink` keeps each block's first KIVI key in fp16;
    `key_wide_channels` gives that many KIVI key channels per head one bit more (uncalibrated
    until `calibrated`); `symmetric_values` stores KIVI values without zero-points. Every setting is checked,
    whether or not `name` uses it, so a bad configuration fails the same way for every format.
    head_dim-dependent checks (group_size divides it, ...) happen in `fields`."""
    if name not in FORMAT_NAMES:
        raise ValueError(f'kv_cache_dtype: unknown format "{name}"; choose one of {", ".join(FORMAT_NAMES)}')
    if role not in ("k", "v"):
        raise ValueError(f'role: must be "k" or "v", got {role!r}')
    check_format_options(group_size, outliers, sparse_threshold, sparse_capacity, fp8_scales, key_wide_channels)

    plain = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    absmax = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
    if name in plain:
        return _PlainFormat(name, plain[name])
    if name in absmax:
        if fp8_scales == "head" and name != "int8":
            return HeadScaleFormat(name, absmax[name])
        return _AbsMaxFormat(name, absmax[name])
    if name == "int4":
        return _GroupFormat(name, 4, group_size)
    if name in ("kivi2", "kivi4"):
        bits = int(name[-1])
        if role == "k":
            return ChannelFormat(name, bits, exact_sink, key_wide_channels)
        return _GroupFormat(name, bits, group_size, symmetric_values)
    if name == "outlier":
        return _OutlierFormat(group_size, outliers)
    return _SparseFormat(sparse_threshold, sparse_capacity)
