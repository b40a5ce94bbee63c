"""What a KV pool costs before it is built: bytes per block, plus the full-precision staging slots
a compressed format with a residual window keeps. The engine and every tensor-parallel rank size
their pools with it; the doctor and `kvserve tune-kv` price formats with it.

It reads a model's shape through the protocol below (what kvserve.model.config.ModelConfig
provides); the engine's configuration passes its settings in (`EngineConfig.kv_sizes`)."""
from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from kvserve.cache.kv_pool import KVPool
from kvserve.cache.quantized_pool import LayerFormats, QuantizedKVPool


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
    def of(model: ModelShape, block_size: int, dtype: torch.dtype, formats: list[LayerFormats] | None,
           max_num_seqs: int, residual: int, step_tokens: int, layers_per_block: int | None = None) -> KVSizes:
        """A pool of `block_size`-token blocks holding `model`'s K/V in `dtype` (`formats` None) or in
        each layer's formats; `layers_per_block`: the layers a block holds (cache/kv_groups.py; None:
        every layer). Staging for `max_num_seqs` sequences, `residual` full-precision tokens each,
        and steps of `step_tokens`."""
        dense = KVPool.bytes_per_block(layers_per_block or model.num_layers, block_size, model.num_kv_heads,
                                       model.head_dim, dtype)
        if formats is None:
            return KVSizes(dense, 0, 0)
        if layers_per_block:  # a block holds that many layers (one format for all)
            formats = formats[:layers_per_block]
        staging = QuantizedKVPool.staging_slots(max_num_seqs, block_size, residual, formats, step_tokens)
        return KVSizes(QuantizedKVPool.bytes_per_block(block_size, model.num_kv_heads, model.head_dim, formats),
                       staging, dense * staging)

    def memory_for(self, num_blocks: int) -> int:
        """The kv_cache_memory that gives exactly num_blocks blocks."""
        return self.staging_bytes + self.block_bytes * num_blocks
