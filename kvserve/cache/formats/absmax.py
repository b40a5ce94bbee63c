"""Whole-byte codes (int8, fp8) scaled by the absolute maximum: a dynamic scale per token and head
(`AbsMaxFormat`), or a fixed one per KV head, calibrated once (`HeadScaleFormat`)."""
from __future__ import annotations

import torch

from kvserve.cache.formats.base import FieldSpec, Fields, PerTokenFormat
from kvserve.cache.formats.codes import MIN_SCALE, fp16_rounded
from kvserve.cache.formats.layout import PageKind, PageLayout


class AbsMaxFormat(PerTokenFormat):
    """Symmetric codes (int8 or fp8) with one fp16 scale per token and head: scale = amax / the
    code's max, rounded up so the largest entry never leaves the code's range (fp8 e4m3 has no
    infinity: an overflow would become NaN)."""

    def __init__(self, name: str, code_dtype: torch.dtype) -> None:
        self.name, self.code_dtype = name, code_dtype
        self.is_float = code_dtype.is_floating_point
        # int8 drops -128 so that the range is symmetric and -x encodes as -code.
        self.qmax = torch.finfo(code_dtype).max if self.is_float else torch.iinfo(code_dtype).max

    @property
    def layout(self) -> PageLayout:
        return PageLayout(PageKind.ABSMAX)

    def token_fields(self, num_kv_heads: int, head_dim: int) -> FieldSpec:
        return {"codes": ((num_kv_heads, head_dim), self.code_dtype),
                "scale": ((num_kv_heads,), torch.float16)}

    def encode(self, x: torch.Tensor) -> Fields:
        x = x.float()
        scale = fp16_rounded((x.abs().amax(-1) / self.qmax).clamp_min(MIN_SCALE), up=True)
        y = (x / scale.float().unsqueeze(-1)).clamp(-self.qmax, self.qmax)
        if not self.is_float:  # float8 casts round to nearest; integer casts would truncate
            y = y.round()
        return {"codes": y.to(self.code_dtype), "scale": scale}

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        return (fields["codes"].float() * fields["scale"].float().unsqueeze(-1)).to(dtype)


class HeadScaleFormat(PerTokenFormat):
    """fp8 codes with one fixed fp32 scale per KV head, calibrated once (vLLM's per-head scales):
    no scale is computed or stored per token, so a page is its codes alone. An entry beyond the
    calibrated range saturates at the code's max. Built uncalibrated (`head_scale` None: its
    size is known, it cannot encode yet); `calibrated` gives the format that can."""

    def __init__(self, name: str, code_dtype: torch.dtype, head_scale: torch.Tensor | None = None) -> None:
        self.name, self.code_dtype = name, code_dtype
        self.qmax = torch.finfo(code_dtype).max
        self.head_scale = None if head_scale is None else head_scale.float()  # [num_kv_heads]

    @property
    def layout(self) -> PageLayout:
        return PageLayout(PageKind.HEAD_ABSMAX, head_scale=self.head_scale)

    @property
    def calibrated_per_layer(self) -> bool:
        return True

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
