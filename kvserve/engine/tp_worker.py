"""A tensor-parallel rank other than 0: the engine's model slice, pool and runner, and no
scheduler. It loads the model as rank 0 does, keeps its shard, builds a pool of rank 0's block
count over its own KV heads, and runs every step rank 0 broadcasts until told to stop.

A block id means the same block on every rank, so rank 0's block manager serves them all; a rank
plans nothing itself (a compressed pool's staging arrives in the step's `kv_plan`), and
`ModelRunner.apply` on a `BlockMoves` is a step with moves and no sequence."""
from __future__ import annotations

import logging

import torch

from kvserve.attention import make_backend
from kvserve.attention.rotation import kv_rotation
from kvserve.config import EngineConfig
from kvserve.distributed.sharding import shard_config, shard_model, shard_of
from kvserve.distributed.tp_group import broadcast_object, init_group
from kvserve.engine.model_runner import BlockMoves, ModelRunner
from kvserve.engine.rank_setup import make_pool, rank_formats
from kvserve.kernels import cpu_extension
from kvserve.model.loader import load_model

logger = logging.getLogger(__name__)


def tp_worker_main(config: EngineConfig, rank: int, port: int, num_blocks: int, timeout_s: float) -> None:
    device = config.model.torch_device
    torch.set_num_threads(max(1, torch.get_num_threads() // config.parallel.tensor_parallel_size))
    loaded = load_model(config.model.model, config.model.torch_dtype, device, config.model.seed)
    cfg = loaded.config
    shard = shard_of(cfg, rank, config.parallel.tensor_parallel_size)
    fmt = config.kv_format
    rotation = kv_rotation(fmt.kv_rotation, cfg.head_dim, config.model.seed, fmt.kv_rotate_keys)
    kernels = cpu_extension.load() if config.runtime.cpu_kernels and device.type == "cpu" else None
    formats = rank_formats(config, loaded.model, loaded.tokenizer, kernels, rotation, shard)
    rank_cfg = shard_config(cfg, shard)
    pool = make_pool(config, rank_cfg, num_blocks, formats, config.kv_sizes(rank_cfg).staging_slots, 0, device)
    group = init_group(rank, config.parallel.tensor_parallel_size, port, timeout_s)
    model = shard_model(loaded.model, shard, group)
    del loaded
    backend = make_backend(config.runtime.attention_backend, pool, rank_cfg.num_heads, device,
                           windowed=bool(rank_cfg.sliding_layers), softcap=rank_cfg.attn_logit_softcapping)
    runner = ModelRunner(model, pool, device, backend, kernels, None, rotation)
    try:
        while (step := broadcast_object(group, None, rank)) is not None:
            if isinstance(step, BlockMoves):  # a step in which no sequence runs
                runner.apply(step)
            else:
                runner.execute(step)
    except RuntimeError as err:  # rank 0 went away without a goodbye (its process ended): so do we
        logger.debug("tensor-parallel rank %d stops: %s", rank, err)
