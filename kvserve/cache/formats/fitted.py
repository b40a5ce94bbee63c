"""fp8 e4m3 codes whose per-token scale is fitted, for keys after a calibrated per-channel offset
(`FittedFP8Format`).

Plain fp8 (`AbsMaxFormat`) maps each token's largest |x| to e4m3's max. e4m3 keeps 3 mantissa
bits, so every entry carries a relative error of up to 1/16, and on keys that is the wrong error:
a few outlier channels hold most of q.k, and a 1/16 error on them moves every logit (int8, whose
error is a 254th of the largest entry, loses 5x less there). Two cheap moves bring fp8 keys near
int8 at the same 8.25 bits:

- An offset: key outlier channels carry a consistent magnitude (KIVI's observation), so each
  layer's KV heads subtract a fixed per-channel mean, calibrated once, before encoding; the
  relative error then applies to the small remainder. Keys are stored after RoPE: the outlier
  channels are slow RoPE pairs, nearly constant over a context, while a fast pair's mean is about
  zero and subtracts nothing (SmolLM2-135M on the calibration text: each head's 3 largest
  channels lie in pairs 17-31 of 32, and their mean holds 84% of their energy, 58% over all).
- A fitted scale: e4m3's grid repeats every power of two, so scales over one binade are every
  grid the code has. Each token and head takes, of `FIT_STEPS` scales in that binade, the one
  whose error e moves its logits least, e^T E[q q^T] e with the head's calibrated query second
  moment (queries of a GQA group together): the outlier channels' entries land on or near grid
  points, the error going where queries do not look.

Values (no calibration asked) take the fitted scale with plain squared error and no offset (in
an offline probe of attention outputs on the Python docs, a mean subtracted from values made their
error larger, not smaller).

No kernel reads these pages (the layout has no kind): the C++ encoder writes plain absmax
scales, and the offset must be added back, so the torch backend decodes them through `decode`.
"""
from __future__ import annotations

import torch

from kvserve.cache.formats.base import FieldSpec, Fields, PerTokenFormat
from kvserve.cache.formats.codes import MIN_SCALE, fp16_rounded
from kvserve.cache.formats.layout import PageLayout

# Scales tried per token and head, evenly spaced in log over one binade. 64 measured better than
# 32 (attention KL of fp8 keys on the Python docs, summed over layers, 0.0206 vs 0.0252 with
# diagonal weights); e4m3 has 8 grid points a binade, so finer steps align the outliers closer.
FIT_STEPS = 64
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


class FittedFP8Format(PerTokenFormat):
    """fp8 e4m3 codes and one fp16 scale per token and head (AbsMaxFormat's fields), the scale
    fitted to `weight` [H, D, D] (None: plain squared error), after subtracting `offset` [H, D]
    (None: nothing). `calibrate` True (keys): the engine calibrates it at start-up (`calibrated`);
    until then it encodes as values do, so a format read from a name alone still round-trips."""

    def __init__(self, name: str, calibrate: bool, offset: torch.Tensor | None = None,
                 weight: torch.Tensor | None = None) -> None:
        self.name, self.calibrate = name, calibrate
        self.offset = None if offset is None else offset.float()  # [num_kv_heads, D]
        self.weight = None if weight is None else weight.float()  # [num_kv_heads, D, D]
        steps = torch.arange(FIT_STEPS, dtype=torch.float32)
        self.targets = FP8_MAX * 2.0 ** (-steps / FIT_STEPS)  # what the largest |x| maps to

    @property
    def layout(self) -> PageLayout:
        return PageLayout(None)

    def calibrated(self, key_mean: torch.Tensor, query_moment: torch.Tensor) -> "FittedFP8Format":
        """This format with each KV head's key mean `key_mean` [H, D] as its offset and its queries'
        second moment `query_moment` [H, D, D] as the error's weight."""
        return FittedFP8Format(self.name, self.calibrate, key_mean, query_moment)

    def token_fields(self, num_kv_heads: int, head_dim: int) -> FieldSpec:
        if self.weight is not None and self.weight.shape[:2] != (num_kv_heads, head_dim):
            raise ValueError(f"{self.name}: calibrated for {tuple(self.weight.shape[:2])} (KV heads, head_dim), "
                             f"got {(num_kv_heads, head_dim)}")
        return {"codes": ((num_kv_heads, head_dim), FP8), "scale": ((num_kv_heads,), torch.float16)}

    def _cost(self, err: torch.Tensor) -> torch.Tensor:
        """err [..., H, D] -> [..., H]: e^T W e per head, or |e|^2 without weights."""
        if self.weight is None:
            return err.square().sum(-1)
        return torch.einsum("...hd,hde,...he->...h", err, self.weight.to(err.device), err)

    def encode(self, x: torch.Tensor) -> Fields:
        x = x.float()
        if self.offset is not None:
            x = x - self.offset.to(x.device)
        amax = x.abs().amax(-1)
        best_codes, best_scale, best_cost = None, None, None
        for target in self.targets.tolist():
            # Rounded up, so that the largest entry stays within the code's range (e4m3 has no
            # infinity: an overflow would become NaN). Codes are kept as fp32 while compared
            # (torch.where takes no fp8); they are fp8 values, so the last cast is exact.
            scale = fp16_rounded((amax / target).clamp_min(MIN_SCALE), up=True)
            codes = (x / scale.float().unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).float()
            cost = self._cost(codes * scale.float().unsqueeze(-1) - x)
            if best_cost is None:
                best_codes, best_scale, best_cost = codes, scale, cost
                continue
            better = cost < best_cost
            best_codes = torch.where(better.unsqueeze(-1), codes, best_codes)
            best_scale = torch.where(better, scale, best_scale)
            best_cost = torch.where(better, cost, best_cost)
        return {"codes": best_codes.to(FP8), "scale": best_scale}

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        codes = fields["codes"]
        x = codes.float() * fields["scale"].float().unsqueeze(-1)
        if self.offset is not None:
            x = x + self.offset.to(codes.device)
        return x.to(dtype)
