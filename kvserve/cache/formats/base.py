"""The interface every KV storage format implements: how one block of K or V is laid out
(`fields`, `layout`), encoded and decoded.

Every format is pure torch on whatever device its inputs live on; encoding and decoding work in
fp32 whatever the input dtype. A format for keys may differ from the one for values (KIVI
quantizes keys per channel across a block and values per token).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from kvserve.cache.formats.layout import PageLayout

FieldSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]
Fields = dict[str, torch.Tensor]


class KVFormat(ABC):
    name: str

    @property
    @abstractmethod
    def layout(self) -> PageLayout:
        """How a kernel reads this format's pages (kind None: through `decode` alone)."""

    @property
    def per_token(self) -> bool:
        """False: encoded a whole block at a time (the layout's word, read by the pool and config)."""
        return self.layout.per_token

    @property
    def calibrated_per_layer(self) -> bool:
        """Whether the engine calibrates this format on each layer's keys or values at start-up
        (engine/kv_calibration.py), so that layers differ in what they encode with."""
        return False

    @property
    def reads_rope_pairs(self) -> bool:
        """Whether the format codes keys by their RoPE pairs (channel i with i + D/2), which a rotation
        of the keys before the pages would mix (KVFormatOptions refuses the two together)."""
        return False

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
        """What a token costs in pages, side tables included: the price the pool and the memory
        planner charge, read from `fields`, the one declaration of the storage."""
        spec = self.fields(num_kv_heads, head_dim, block_size)
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in spec.values()) / block_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class PerTokenFormat(KVFormat):
    """A format that encodes each token (and head) on its own: encode and decode are elementwise
    over every dim before the last two, so they commute with slicing and scattering tokens."""

    @abstractmethod
    def token_fields(self, num_kv_heads: int, head_dim: int) -> FieldSpec:
        """Storage of one token, shapes starting with num_kv_heads."""

    def fields(self, num_kv_heads: int, head_dim: int, block_size: int) -> FieldSpec:
        return {key: ((block_size, *shape), dtype)
                for key, (shape, dtype) in self.token_fields(num_kv_heads, head_dim).items()}
