"""Fitted midrise grids (`quantize_midrise(fit=True)`, symmetric KIVI values): each group's codes are
the least-squared-error ones among the candidate scales, checked against a search written out here
entry by entry, and they decode as before."""
from __future__ import annotations

import torch

from kvserve.cache.formats import make_format
from kvserve.cache.formats.codes import FIT_RATIOS, dequantize_midrise, fp16_rounded, quantize_midrise


def bell(*shape: int, seed: int = 0) -> torch.Tensor:
    """Gaussian entries with a few large ones, as rotated values and key channels have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    return torch.where(torch.rand(*shape, generator=g) < 0.02, 6 * x, x)


def midrise_error(x: list[float], step: float, bits: int) -> float:
    """Squared error of x on the midrise grid of `step`, one entry at a time."""
    half = 2 ** (bits - 1)
    out = 0.0
    for v in x:
        c = min(max(round(v / step - 0.5), -half), half - 1)
        out += ((c + 0.5) * step - v) ** 2
    return out


def test_fitted_midrise_is_the_best_candidate_of_each_group() -> None:
    x = bell(40, 16)
    for bits in (2, 4):
        codes, scale = quantize_midrise(x, bits, -1, fit=True)
        got = (dequantize_midrise(codes, scale, bits, -1) - x).square().sum(-1)
        half = 2 ** (bits - 1)
        for row, err in zip(x, got):
            amax = row.abs().max().item()
            steps = [fp16_rounded(torch.tensor([amax * r / (half - 0.5)]), up=True).item() for r in FIT_RATIOS]
            best = min(midrise_error(row.tolist(), s, bits) for s in steps)
            assert abs(err.item() - best) <= 1e-4 * max(best, 1e-6)
        plain_codes, plain_scale = quantize_midrise(x, bits, -1)
        plain = (dequantize_midrise(plain_codes, plain_scale, bits, -1) - x).square().sum(-1)
        assert (got <= plain * (1 + 1e-6)).all() and got.sum() < plain.sum()


def test_symmetric_values_are_fitted_and_decode_as_their_layout_says() -> None:
    """Fitting changes which codes the encoder picks, not how pages are read (the kernels decode
    them from the layout): the fields decoded by hand give the format's decode."""
    values = make_format("kivi2", "v", group_size=64, symmetric_values=True)
    x = bell(5, 2, 64)
    f = values.encode(x)
    codes = torch.stack([(f["codes"] >> shift) & 3 for shift in (0, 2, 4, 6)], -1).flatten(-2)
    by_hand = (codes.float() - 1.5) * f["scale"].float().repeat_interleave(64, -1)
    torch.testing.assert_close(values.decode(f, torch.float32), by_hand)
    fitted, scale = quantize_midrise(x.unflatten(-1, (1, 64)), 2, -1, fit=True)
    assert torch.equal(f["scale"], scale)
    assert (f["scale"].float() < x.abs().amax(-1, keepdim=True) / 1.5).any()  # some group is not absmax
