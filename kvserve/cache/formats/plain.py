"""Pages in a floating-point dtype as computed (bf16, fp16, fp32): no codes, no scales."""
from __future__ import annotations

import torch

from kvserve.cache.formats.base import FieldSpec, Fields, PerTokenFormat
from kvserve.cache.formats.layout import PageKind, PageLayout


class PlainFormat(PerTokenFormat):
    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype

    @property
    def layout(self) -> PageLayout:
        return PageLayout(PageKind.DENSE)

    def token_fields(self, num_kv_heads: int, head_dim: int) -> FieldSpec:
        return {"data": ((num_kv_heads, head_dim), self.dtype)}

    def encode(self, x: torch.Tensor) -> Fields:
        return {"data": x.to(self.dtype)}

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        return fields["data"].to(dtype)
