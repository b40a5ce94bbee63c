"""The numeric pieces the quantized formats share: fp16 scales and zero-points rounded so that
error bounds hold against the stored values, asymmetric and midrise codes, and bit packing.

Scales and zero-points are stored in fp16 and chosen *after* fp16 rounding, so the per-entry
error bounds documented here hold against the stored values, not against some fp32 value the
decoder never sees. Inputs must lie within fp16 range (|x| < 65504), since zero-points and
outliers are stored in fp16.
"""
from __future__ import annotations

import math

import torch

# Smallest scale ever stored: fp16's smallest normal number. A smaller one (1e-6, say) would still
# be representable, but as a subnormal: with a fixed step of 2^-24 it keeps few significant bits,
# rounding it up to cover the range inflates it by up to 2x near the bottom, and its reciprocal
# (1e6) overflows fp16 in a kernel that divides in half precision; 1 / 2^-14 = 16384 does not.
# The cost, a step of at least 6.1e-5 for a token or group whose whole range is smaller than
# qmax times that, is far below anything attention can notice.
MIN_SCALE = 2.0 ** -14
# Fractions of the absmax scale a fitted midrise grid tries (`quantize_midrise(fit=True)`): 0.5 and
# above, where the best 2-bit grid of a Gaussian group of 64 (about 0.6) lies.
FIT_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)


def fp16_rounded(x: torch.Tensor, up: bool) -> torch.Tensor:
    """x (fp32) in fp16, rounded toward +inf (up) or -inf instead of to nearest."""
    h = x.to(torch.float16)
    wrong_side = h.float() < x if up else h.float() > x
    toward = torch.full_like(h, math.inf if up else -math.inf)
    return torch.where(wrong_side, torch.nextafter(h, toward), h)


def quantize_asym(x: torch.Tensor, bits: int | torch.Tensor, dim: int, include: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric `bits`-bit codes (uint8, unpacked) with one fp16 scale and zero-point per slice
    reduced along `dim`; decoding is code * scale + zero, within scale / 2 of x. Only entries where
    `include` is True set the range; the others are clamped (their caller stores them elsewhere).
    `bits` may be a tensor of bits per slice (broadcasting against the reduced shape, at most 8):
    a 0-bit slice's codes are all 0 and its scale spans its range, as a 1-bit one's would."""
    qmax = torch.as_tensor(2 ** bits - 1, dtype=torch.float32, device=x.device)
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
    zero = fp16_rounded(lo, up=False)
    scale = fp16_rounded(((hi - zero.float()) / qmax.clamp_min(1)).clamp_min(MIN_SCALE), up=True)
    codes = ((x - zero.float()) / scale.float()).round().clamp(torch.zeros_like(qmax), qmax).to(torch.uint8)
    return codes, scale.squeeze(dim), zero.squeeze(dim)


def dequantize_asym(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dim: int) -> torch.Tensor:
    return codes.float() * scale.float().unsqueeze(dim) + zero.float().unsqueeze(dim)


def quantize_midrise(x: torch.Tensor, bits: int, dim: int, fit: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric `bits`-bit codes with no zero-point: code c (uint8) decodes as (c - 2^(b-1) + 1/2) *
    scale, levels placed evenly about zero with none *at* zero, so all 2^b of them are used (an
    absmax grid with a zero level wastes one). One fp16 scale per slice along `dim`, rounded up so
    that the largest |x| is within the outermost level: decoding is within scale / 2 of x.

    `fit`: each slice's scale is instead the one among `FIT_RATIOS` x that absmax scale whose codes
    decode with the least squared error (the absmax one is a candidate, so it is never worse by
    that measure); entries beyond the outermost level saturate there. At 2 bits an absmax grid puts
    its levels at +-1/3 and +-1 of the largest |x|, far apart for the bulk of a bell-shaped group
    (a rotated one is about Gaussian): a tighter grid trades a few clipped tails for it. Decoding
    is unchanged."""
    half = 2 ** (bits - 1)
    x = x.float()
    amax = x.abs().amax(dim, keepdim=True)
    best: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # codes, scale, squared error
    for ratio in FIT_RATIOS if fit else (1.0,):
        scale = fp16_rounded((amax * ratio / (half - 0.5)).clamp_min(MIN_SCALE), up=True)
        codes = (x / scale.float() - 0.5).round().clamp(-half, half - 1) + half
        error = ((codes - (half - 0.5)) * scale.float() - x).square().sum(dim, keepdim=True)
        if best is None:
            best = codes, scale, error
        else:
            better = error < best[2]
            best = tuple(torch.where(better, new, old) for new, old in zip((codes, scale, error), best))
    codes, scale, _ = best
    return codes.to(torch.uint8), scale.squeeze(dim)


def dequantize_midrise(codes: torch.Tensor, scale: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    return (codes.float() - (2 ** (bits - 1) - 0.5)) * scale.float().unsqueeze(dim)


def _bit_shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes < 2**bits, last dim L -> uint8 [..., L * bits / 8], first code in the low bits."""
    shifts = _bit_shifts(bits, codes.device)
    grouped = codes.unflatten(-1, (-1, len(shifts)))
    # The codes occupy disjoint bits, so their sum is their bitwise or.
    return (grouped << shifts).sum(-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    shifts = _bit_shifts(bits, packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & (2 ** bits - 1)).flatten(-2)


def check_packable(name: str, head_dim: int, bits: int) -> None:
    if head_dim % (8 // bits):
        raise ValueError(f"{name}: head_dim {head_dim} must be a multiple of {8 // bits} to pack its codes")


def check_index_range(name: str, head_dim: int) -> None:
    if head_dim > 256:
        raise ValueError(f"{name}: head_dim {head_dim} does not fit its uint8 channel indices (max 256)")
