"""What every tensor-parallel rank builds the same way, the engine (rank 0) and its workers
(tp_worker.py): what its pool costs, each layer's page formats for its KV heads, and the pool."""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvserve.attention.rotation import KVRotation
from kvserve.cache.kv_pool import KVPool
from kvserve.cache.quantized_pool import LayerFormats, QuantizedKVPool
from kvserve.config import EngineConfig
from kvserve.distributed.sharding import Shard
from kvserve.engine.kv_calibration import calibrate_formats, calibration_tokens, measure_kv_stats, needs_calibration
from kvserve.model.config import ModelConfig
from kvserve.model.ops import resolve_ops

logger = logging.getLogger(__name__)


def rank_formats(config: EngineConfig, model: torch.nn.Module, tokenizer: Any, kernels: Any,
                 rotation: KVRotation | None, shard: Shard | None) -> list[LayerFormats] | None:
    """Each layer's (keys, values) formats for a rank's pool (`shard` None: the whole model's);
    per-head fp8 scales and wide key channels calibrated on the whole model, then cut to the
    rank's KV heads."""
    formats = config.kv_layer_formats(model.config.num_layers)
    if not needs_calibration(formats):
        return formats
    start = time.perf_counter()
    fmt = config.kv_format
    ids = calibration_tokens(tokenizer, model.config.vocab_size, fmt.kv_calibration_tokens, config.model.seed,
                             fmt.kv_calibration_data)
    stats = measure_kv_stats(model, resolve_ops(kernels), ids, rotation, config.model.torch_dtype,
                             config.model.torch_device, config.cache.block_size, fmt.kv_exact_sink)
    if shard is not None:
        stats = stats.heads(list(shard.kv_heads))
    logger.info("kvserve: KV formats calibrated on %d tokens in %.1f s", len(ids), time.perf_counter() - start)
    return calibrate_formats(formats, stats)


def make_pool(config: EngineConfig, cfg: ModelConfig, num_blocks: int, formats: list[LayerFormats] | None,
              staging: int, num_host_blocks: int, device: torch.device,
              layers_per_block: int | None = None) -> KVPool | QuantizedKVPool:
    """`layers_per_block`: the layers a block holds (cache/kv_groups.py; None: every layer)."""
    block_size, dtype = config.cache.block_size, config.model.torch_dtype
    if formats is None:
        return KVPool(layers_per_block or cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                      dtype, device, num_host_blocks)
    # Hybrid: a block holds `layers_per_block` layers, all in one format (EngineConfig checks).
    return QuantizedKVPool(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device,
                           formats[:layers_per_block or len(formats)], config.residual_tokens, staging)
