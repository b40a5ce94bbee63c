"""Formats that keep chosen entries exactly, as an fp16 value and a uint8 channel: int4 with
exact outliers (`OutlierFormat`), and the largest entries alone (`SparseFormat`). No kernel reads
them; the torch backend decodes them."""
from __future__ import annotations

import math

import torch

from kvserve.cache.formats.base import FieldSpec, Fields, PerTokenFormat
from kvserve.cache.formats.codes import check_index_range
from kvserve.cache.formats.grouped import GroupFormat
from kvserve.cache.formats.layout import PageLayout
from kvserve.validate import FieldError


class OutlierFormat(GroupFormat):
    """int4 group-wise, except that each token-head's `outliers` largest-magnitude entries are kept
    exactly (fp16 value + uint8 channel) and left out of their group's range, so one huge channel
    does not coarsen the step of its whole group."""

    def __init__(self, group_size: int, outliers: int) -> None:
        super().__init__("outlier", 4, group_size)
        self.outliers = outliers

    @property
    def layout(self) -> PageLayout:
        return PageLayout(None, bits=self.bits, group_size=self.group_size)

    def check_head_dim(self, head_dim: int) -> None:
        super().check_head_dim(head_dim)
        check_index_range(self.name, head_dim)
        if self.outliers > head_dim:
            raise FieldError("kv_outliers", f"kv_outliers {self.outliers} exceeds head_dim {head_dim}")

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


class SparseFormat(PerTokenFormat):
    """Per token and head, up to `capacity` entries as fp16 value + uint8 channel: the largest in
    magnitude, of those only the ones with |x| >= threshold * rms(x); everything else decodes as 0.
    A dropped slot stores value 0 (its index is then irrelevant).

    The stored fields do not determine head_dim (ceil(capacity * head_dim) is not invertible), so
    the format binds to the head_dim it first sees in `fields` or `encode`, as a cache's does."""
    name = "sparse"

    def __init__(self, threshold: float, capacity: float) -> None:
        self.threshold, self.capacity = threshold, capacity
        self.head_dim: int | None = None

    @property
    def layout(self) -> PageLayout:
        return PageLayout(None)

    def slots(self, head_dim: int) -> int:
        check_index_range(self.name, head_dim)
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
