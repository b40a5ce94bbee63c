"""What a KV pool costs before it is built: bytes per block, plus the full-precision staging slots
a compressed format with a residual window keeps. The engine and every tensor-parallel rank size
their pools with it; the doctor and `kvserve tune-kv` price formats with it.

It reads an engine config and a model's shape through the two protocols below (what
kvserve.config.EngineConfig and kvserve.model.config.ModelConfig provide), so the cache layer
imports neither."""
from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from kvserve.cache.kv_pool import KVPool
from kvserve.cache.quantized_pool import LayerFormats, QuantizedKVPool


class PoolSettings(Protocol):
    """The engine config's fields that decide a pool's size."""
    @property
    def block_size(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_model_len(self) -> int | None: ...
    @property
    def residual_tokens(self) -> int: ...
    @property
    def torch_dtype(self) -> torch.dtype: ...
    def kv_layer_formats(self, num_layers: int) -> list[LayerFormats] | None: ...
    def tokens_per_step(self, max_model_len: int) -> int: ...


class ModelShape(Protocol):
    """The model config's fields that decide a pool's size."""
    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def max_position(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class KVSizes:
    """What a KV pool costs: bytes per block, plus the full-precision staging slots a compressed
    format with a residual window keeps (max_num_seqs decides how many)."""
    block_bytes: int
    staging_slots: int
    staging_bytes: int

    @staticmethod
    def of(config: PoolSettings, cfg: ModelShape, layers_per_block: int | None = None) -> KVSizes:
        """`layers_per_block`: the layers a block holds (cache/kv_groups.py; None: every layer)."""
        dense = KVPool.bytes_per_block(layers_per_block or cfg.num_layers, config.block_size, cfg.num_kv_heads,
                                       cfg.head_dim, config.torch_dtype)
        formats = config.kv_layer_formats(cfg.num_layers)
        if formats is not None and layers_per_block:  # a block holds that many layers (one format for all)
            formats = formats[:layers_per_block]
        if formats is None:
            return KVSizes(dense, 0, 0)
        step_tokens = config.tokens_per_step(config.max_model_len or cfg.max_position)
        staging = QuantizedKVPool.staging_slots(config.max_num_seqs, config.block_size, config.residual_tokens,
                                                formats, step_tokens)
        return KVSizes(QuantizedKVPool.bytes_per_block(config.block_size, cfg.num_kv_heads, cfg.head_dim, formats),
                       staging, dense * staging)

    def memory_for(self, num_blocks: int) -> int:
        """The kv_cache_memory that gives exactly num_blocks blocks."""
        return self.staging_bytes + self.block_bytes * num_blocks
