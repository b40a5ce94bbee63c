"""Whole-byte codes (fp8 e4m3 or int8) whose per-token scale is fitted, for keys after a calibrated
per-channel offset (`FittedFormat`).

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

int8 codes (`int8_fit`) take both (the scales tried then run from the token's largest |x| / 127 to
twice that, nothing clipped), and a third that fp8 does not need: per-channel equalisation. int8's
error is not relative but a step of the token's largest |x| / 127, and on Gemma 3 (head_dim 256,
k_norm's per-channel weights) a few key channels are 5-10x the token's rms and vary widely about
their mean (layer 11: channel 254 at -72 +- 9, channels 241 and 119 at -43 +- 23 and -34 +- 20,
the token's rms 8), while queries hardly look at them (E[q_d^2] 0.0-0.2): the offset cannot take
that spread out, and it alone sets the step of all 256 channels. So each channel is divided by its
calibrated spread (the largest |k_d - mean_d| over the calibration tokens) before the per-token
codes and multiplied back on decode: a channel's step becomes proportional to its own range, not
to the widest channel's, and the weight is taken into the same basis (S W S). A channel may exceed
its calibrated spread on other text: the per-token scale then grows, nothing clips. The spread is
floored at `SPREAD_FLOOR` of the head's mean spread, so a channel nearly constant in calibration
cannot blow up a token that moves it. (fp8's error is relative already; an offline probe found
equalised fp8 keys no better, so `fp8_e4m3_fit` does not equalise.)

Values (no calibration asked) take the fitted scale with plain squared error and no offset (in
an offline probe of attention outputs on the Python docs, a mean subtracted from values made their
error larger, not smaller).

The pages are ABSMAX's (codes, one fp16 scale per token and head), so the cpu kernel reads them in
place (`PageLayout.fitted`): a key's offset adds q.offset to every logit of a query alike, which
softmax cancels, and the spread is folded into the query. The cpu backend writes them with the
kernels' `encode_fitted_write`, the same search per token as `encode` (a near-tie may break the
other way: the costs are summed in another order). SmolLM2, 8 rows decoding at ~450 tokens with
int8_fit: 371-409 ms a step on the torch backend, which decoded every page each step; 34-36 ms so
(int8: 16). What is left is the search's e^T W e, D^2 a candidate for each key token and head
(BENCHMARKS.md). The Triton kernel does not read them.
"""
from __future__ import annotations

import torch

from kvserve.cache.formats.base import FieldSpec, Fields, PerTokenFormat
from kvserve.cache.formats.codes import MIN_SCALE, fp16_rounded
from kvserve.cache.formats.layout import FitTables, PageKind, PageLayout

# Scales tried per token and head, evenly spaced in log over one binade. 64 measured better than
# 32 (attention KL of fp8 keys on the Python docs, summed over layers, 0.0206 vs 0.0252 with
# diagonal weights); e4m3 has 8 grid points a binade, so finer steps align the outliers closer.
FIT_STEPS = 64
# The least spread a channel is equalised by, as a share of its head's mean spread (see above).
SPREAD_FLOOR = 1 / 8
# Values per chunk of the candidates' codes (FIT_STEPS copies of the tokens encoded at once): 16 MB
# of fp32 a temporary, whatever the prompt's length.
_CANDIDATE_VALUES = 1 << 22


class FittedFormat(PerTokenFormat):
    """`code_dtype` codes (fp8 e4m3 or int8) and one fp16 scale per token and head (AbsMaxFormat's
    fields), the scale fitted to `weight` [H, D, D] (None: plain squared error), after subtracting
    `offset` [H, D] (None: nothing) and dividing by `spread` [H, D] (None: nothing; `weight` is in
    that divided basis). `calibrate` True (keys): the engine calibrates it at start-up
    (`calibrated`), with a spread if `equalise`; until then it encodes as values do, so a format
    read from a name alone still round-trips."""

    def __init__(self, name: str, code_dtype: torch.dtype, calibrate: bool, equalise: bool = False,
                 offset: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                 spread: torch.Tensor | None = None) -> None:
        self.name, self.code_dtype, self.calibrate, self.equalise = name, code_dtype, calibrate, equalise
        self.is_float = code_dtype.is_floating_point
        # int8 drops -128 (as AbsMaxFormat): a symmetric range, -x encodes as -code.
        self.qmax = torch.finfo(code_dtype).max if self.is_float else torch.iinfo(code_dtype).max
        self.offset = None if offset is None else offset.float().contiguous()  # [num_kv_heads, D]
        self.weight = None if weight is None else weight.float().contiguous()  # [num_kv_heads, D, D]
        self.spread = None if spread is None else spread.float().contiguous()  # [num_kv_heads, D]
        steps = torch.arange(FIT_STEPS, dtype=torch.float32)
        self.targets = self.qmax * 2.0 ** (-steps / FIT_STEPS)  # what the largest |x| maps to

    @property
    def layout(self) -> PageLayout:
        fit = FitTables(self.targets, self.offset, self.spread, self.weight)
        return PageLayout(PageKind.ABSMAX, fitted=True, fit=fit)

    @property
    def calibrated_per_layer(self) -> bool:
        return self.calibrate

    def calibrated(self, key_mean: torch.Tensor, query_moment: torch.Tensor,
                   key_spread: torch.Tensor) -> "FittedFormat":
        """This format with each KV head's key mean `key_mean` [H, D] as its offset, its queries'
        second moment `query_moment` [H, D, D] as the error's weight, and (if it equalises) its
        keys' largest |k - mean| per channel `key_spread` [H, D] as the spread."""
        spread, weight = None, query_moment.float()
        if self.equalise:
            spread = key_spread.float()
            spread = spread.maximum(SPREAD_FLOOR * spread.mean(-1, keepdim=True)).clamp_min(MIN_SCALE)
            weight = spread.unsqueeze(-1) * weight * spread.unsqueeze(-2)  # the error in the divided basis
        return FittedFormat(self.name, self.code_dtype, self.calibrate, self.equalise, key_mean, weight, spread)

    def token_fields(self, num_kv_heads: int, head_dim: int) -> FieldSpec:
        if self.weight is not None and self.weight.shape[:2] != (num_kv_heads, head_dim):
            raise ValueError(f"{self.name}: calibrated for {tuple(self.weight.shape[:2])} (KV heads, head_dim), "
                             f"got {(num_kv_heads, head_dim)}")
        return {"codes": ((num_kv_heads, head_dim), self.code_dtype), "scale": ((num_kv_heads,), torch.float16)}

    def _cost(self, err: torch.Tensor) -> torch.Tensor:
        """err [..., H, D] -> [..., H]: e^T W e per head, or |e|^2 without weights."""
        if self.weight is None:
            return err.square().sum(-1)
        return torch.einsum("...hd,hde,...he->...h", err, self.weight.to(err.device), err)

    def encode(self, x: torch.Tensor) -> Fields:
        x = x.float()
        if self.offset is not None:
            x = x - self.offset.to(x.device)
        if self.spread is not None:
            x = x / self.spread.to(x.device)
        # Every candidate scale at once, tokens in chunks that bound the candidates' copies of x: a
        # loop over the candidates cost ~10 torch calls each, 640 a layer, most of a decode step.
        flat = x.reshape(-1, *x.shape[-2:])
        step = max(1, _CANDIDATE_VALUES // (FIT_STEPS * x.shape[-2] * x.shape[-1]))
        codes, scales = zip(*(self._fit(flat[i:i + step]) for i in range(0, max(len(flat), 1), step)))
        return {"codes": torch.cat(codes).reshape(x.shape), "scale": torch.cat(scales).reshape(x.shape[:-1])}

    def _fit(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, H, D] -> codes [n, H, D] and fp16 scales [n, H]: of the candidate scales, each
        token and head's of least cost (the first such)."""
        targets = self.targets.to(x.device).view(-1, 1, 1)
        # Rounded up, so that the largest entry stays within the code's range (e4m3 has no
        # infinity: an overflow would become NaN). Codes stay fp32 while compared; they are code
        # values, so the last cast is exact.
        scale = fp16_rounded((x.abs().amax(-1) / targets).clamp_min(MIN_SCALE), up=True)  # [S, n, H]
        codes = (x / scale.float().unsqueeze(-1)).clamp(-self.qmax, self.qmax)
        # float8 casts round to nearest; integer casts would truncate
        codes = codes.to(self.code_dtype).float() if self.is_float else codes.round()
        best = self._cost(codes * scale.float().unsqueeze(-1) - x).argmin(0, keepdim=True)  # [1, n, H]
        chosen = codes.gather(0, best.unsqueeze(-1).expand(1, *codes.shape[1:]))[0]
        return chosen.to(self.code_dtype), scale.gather(0, best)[0]

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        codes = fields["codes"]
        x = codes.float() * fields["scale"].float().unsqueeze(-1)
        if self.spread is not None:
            x = x * self.spread.to(codes.device)
        if self.offset is not None:
            x = x + self.offset.to(codes.device)
        return x.to(dtype)
