"""Values coded as vectors (`VectorFormat`): each token's head cut into pieces of 4 channels, each
piece the nearest of a fixed codebook of 512 points (a 9-bit code, 2.25 bits a value), times one
fp16 scale per token and head.

Why (BENCHMARKS.md, issue 42, the 2.5-bit row): at 2 bits a value the best scalar grid leaves
0.118 of a Gaussian's variance as error; 512 points placed by k-means in 4 dimensions leave 0.070 at
2.25 bits, where the best split of 9 bits over 4 scalar codes (2, 2, 2, 3) leaves 0.097. On SmolLM2
at 2.5 bits a value 2 more bytes a head and token on the values (a quarter of a bit a value at
head_dim 64), paid for by 16 fewer wide key channels, took 14-26% off kivi2_mix_unrope's KL on
five texts.

One codebook for every layer and model: values rotated by kv_rotation are close to Gaussian
channel by channel, and each token is divided by its own root mean square before its pieces are
matched, so the pieces look alike everywhere (a probe found a codebook trained on SmolLM2's own
values no better than one trained on Gaussian samples). The codebook is `train_codebook`'s output
on seeded samples, shipped as `codebook_4x512.f32` (512 x 4 little-endian fp32; regenerate with
`python -m kvserve.cache.formats.vector`) because training takes a minute. After the pieces are
matched, the scale is refitted by least squares, the scale that brings the chosen points closest
to the token.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy
import torch

from kvserve.cache.formats.base import FieldSpec, Fields, PerTokenFormat
from kvserve.cache.formats.codes import pack, unpack
from kvserve.cache.formats.layout import PageLayout

CODEBOOK_FILE = Path(__file__).with_name("codebook_4x512.f32")
CODEBOOK_SHAPE = (512, 4)
# The largest decoded entry: fp16's largest value, less the fp16 rounding of the scale that produces it.
_DECODE_MAX = torch.finfo(torch.float16).max * (1 - 2.0 ** -10)
# Pieces matched against the codebook at once: bounds the distance table (this x 512 fp32, 8 MiB)
# whatever a prefill hands over; 4,096 timed no slower than larger tables.
_CHUNK = 4096


def train_codebook(size: int, dim: int, samples: int, iterations: int, seed: int) -> torch.Tensor:
    """Lloyd's k-means on `samples` unit Gaussian points of `dim` dimensions -> [size, dim] fp32,
    started from `size` of the samples; a point that loses all its samples keeps its place."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, dim, generator=generator)
    book = x[torch.randperm(samples, generator=generator)[:size]].clone()
    for _ in range(iterations):
        nearest = nearest_points(x, book)
        count = torch.bincount(nearest, minlength=size).float()
        total = torch.zeros_like(book).index_add_(0, nearest, x)
        book = torch.where(count[:, None] > 0, total / count.clamp_min(1)[:, None], book)
    return book


def nearest_points(x: torch.Tensor, book: torch.Tensor) -> torch.Tensor:
    """x [N, dim] -> index [N] (int64) of each row's nearest codebook point, by squared distance
    less |x|^2 (the same for every point): |c|^2 - 2 x.c in one addmm, 4-5x faster than the matmul
    and the sum apart (their temporaries were most of the encoder's time)."""
    norms, scaled = book.square().sum(-1), -2 * book.T
    if not len(x):
        return torch.zeros(0, dtype=torch.long, device=x.device)
    return torch.cat([torch.addmm(norms, chunk, scaled).argmin(-1) for chunk in x.split(_CHUNK)])


def load_codebook() -> torch.Tensor:
    """The shipped codebook, [512, 4] fp32."""
    data = CODEBOOK_FILE.read_bytes()
    if len(data) != 4 * math.prod(CODEBOOK_SHAPE):
        raise ValueError(f"{CODEBOOK_FILE}: {len(data)} bytes, not the {CODEBOOK_SHAPE} fp32 codebook")
    return torch.from_numpy(numpy.frombuffer(data, dtype="<f4").astype("=f4")).view(CODEBOOK_SHAPE)


class VectorFormat(PerTokenFormat):
    """Pieces of `codebook.shape[1]` channels coded by their nearest codebook point (at most 9 bits:
    the low 8 in "codes", the ninth in a bit plane "high"), one fp16 scale per token and head."""

    def __init__(self, name: str, codebook: torch.Tensor) -> None:
        if not (codebook.dim() == 2 and 0 < len(codebook) <= 512):
            raise ValueError(f"{name}: a codebook of 1 to 512 points (9-bit codes), got shape {tuple(codebook.shape)}")
        self.name, self.codebook = name, codebook.float()

    @property
    def layout(self) -> PageLayout:
        return PageLayout(None)

    def pieces(self, head_dim: int) -> int:
        width = self.codebook.shape[1]
        if head_dim % width:
            raise ValueError(f"{self.name}: head_dim {head_dim} must be a multiple of {width}, its pieces' width")
        return head_dim // width

    def token_fields(self, num_kv_heads: int, head_dim: int) -> FieldSpec:
        pieces = self.pieces(head_dim)
        return {"codes": ((num_kv_heads, pieces), torch.uint8),
                "high": ((num_kv_heads, math.ceil(pieces / 8)), torch.uint8),
                "scale": ((num_kv_heads, 1), torch.float16)}

    def encode(self, x: torch.Tensor) -> Fields:
        x = x.float()
        pieces = self.pieces(x.shape[-1])
        book = self.codebook.to(x.device)
        rms = x.square().mean(-1, keepdim=True).sqrt().clamp_min(torch.finfo(torch.float32).tiny)
        unit = (x / rms).unflatten(-1, (pieces, -1))
        index = nearest_points(unit.reshape(-1, unit.shape[-1]), book).view(unit.shape[:-1])
        points = book[index].flatten(-2)
        # Least squares: the scale that brings scale * points closest to x; capped so that no decoded
        # entry passes fp16's largest value (the fitted scale times a far point can reach 1.3 x the
        # token's largest entry), and NaN for a token that is not finite, as other formats decode it.
        scale = (x * points).sum(-1, keepdim=True) / points.square().sum(-1, keepdim=True).clamp_min(1e-30)
        cap = _DECODE_MAX / points.abs().amax(-1, keepdim=True).clamp_min(1.0)
        scale = torch.where(x.isfinite().all(-1, keepdim=True), scale.clamp(-cap, cap), math.nan)
        high = (index >> 8).to(torch.uint8)
        padded = torch.nn.functional.pad(high, (0, -pieces % 8))
        return {"codes": (index & 255).to(torch.uint8), "high": pack(padded, 1), "scale": scale.to(torch.float16)}

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        codes = fields["codes"]
        high = unpack(fields["high"], 1)[..., :codes.shape[-1]]
        index = codes.long() | (high.long() << 8)
        points = self.codebook.to(codes.device)[index].flatten(-2)
        return (points * fields["scale"].float()).to(dtype)


if __name__ == "__main__":
    book = train_codebook(*CODEBOOK_SHAPE, samples=1_000_000, iterations=60, seed=0)
    CODEBOOK_FILE.write_bytes(book.contiguous().numpy().astype("<f4").tobytes())
    print(f"wrote {CODEBOOK_FILE} ({tuple(book.shape)})")
