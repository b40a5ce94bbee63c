"""Builds what an engine is made of from its config, once: the model, the KV pool sized from the
budget, the block manager and its tiers, the scheduler, the attention backend and the runner.

The checks that need the loaded model (a prompt budget against its context, a pool against the
contiguous baseline's preallocation) fail here, naming the config field, before anything runs.
"""
from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.attention import make_backend
from kvserve.attention.backend import AttentionBackend
from kvserve.attention.rotation import kv_rotation
from kvserve.cache.block_bytes import block_nbytes
from kvserve.cache.block_manager import BlockManager
from kvserve.cache.kv_groups import KVGroups
from kvserve.cache.kv_pool import KVPool
from kvserve.cache.block_tier import BlockTier
from kvserve.cache.kv_disk import DiskKVTier
from kvserve.cache.kv_events import DISK, REDIS, TierEvents
from kvserve.cache.kv_remote import RemoteKVTier
from kvserve.cache.kv_sizes import KVSizes
from kvserve.cache.quantized_pool import QuantizedKVPool
from kvserve.cache.swap_space import SwapSpace
from kvserve.config import EngineConfig
from kvserve.distributed.sharding import shard_config, shard_model, shard_of
from kvserve.distributed.tp_group import TPGroup
from kvserve.engine.draft_policy import DraftPolicy
from kvserve.engine.kv_event_publisher import ZmqEventPublisher
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.ngram_proposer import NgramProposer
from kvserve.engine.preemption_cost import PreemptionCost
from kvserve.engine.rank_setup import make_pool, rank_formats
from kvserve.engine.remote_namespace import remote_namespace
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.tp_worker import tp_worker_main
from kvserve.kernels import cpu_extension
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from kvserve.threads import fit_torch_threads, long_spin_warning

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineParts:
    config: EngineConfig
    device: torch.device
    model: torch.nn.Module
    model_config: ModelConfig
    model_name: str
    tokenizer: Any  # a Hugging Face tokenizer of whichever class the model ships, or None
    eos_token_id: int | None
    max_model_len: int
    max_num_batched_tokens: int
    kv_bytes_per_token: float  # K/V of one token in every layer (a hybrid block holds a group's layers)
    kv_groups: KVGroups
    pool: KVPool | QuantizedKVPool
    remote: BlockTier | None  # the tier below the prefix cache: Redis (kv_remote) or disk (kv_disk_dir)
    block_manager: BlockManager
    swap: SwapSpace | None
    scheduler: Scheduler
    attention_backend: AttentionBackend
    tp: TPGroup | None
    runner: ModelRunner
    async_scheduling: bool
    kv_events: ZmqEventPublisher | None


def build_engine_parts(config: EngineConfig) -> EngineParts:
    opened: list[BlockTier] = []  # what holds a resource (the disk tier's directory lock) once made
    try:
        return _build_engine_parts(config, opened)
    except BaseException:
        for tier in opened:  # a failed start gives them up now, not when collected
            tier.close()
        raise


def _build_engine_parts(config: EngineConfig, opened: list[BlockTier]) -> EngineParts:
    device = config.model.torch_device
    if device.type == "cpu":
        fit_torch_threads()
        if (spin := long_spin_warning()) is not None:
            logger.warning(spin)
    loaded = load_model(config.model.model, config.model.torch_dtype, device, config.model.seed)
    model, cfg = loaded.model, loaded.config
    config.check_model(cfg)
    max_model_len = config.model.max_model_len or cfg.max_position
    chunked_prefill = config.scheduler.enable_chunked_prefill and config.cache.cache_mode == "paged"
    max_num_batched_tokens = _step_budget(config, max_model_len, chunked_prefill)

    fmt = config.kv_format
    rotation = kv_rotation(fmt.kv_rotation, cfg.head_dim, config.model.seed, fmt.kv_rotate_keys)
    kernels = cpu_extension.load() if config.runtime.cpu_kernels and device.type == "cpu" else None
    # With tensor parallelism this process is rank 0: its pool holds its own KV heads, the most of
    # any rank, so the block count it derives from the budget fits every rank.
    world = config.parallel.tensor_parallel_size
    shard = shard_of(cfg, 0, world) if world > 1 else None
    formats = rank_formats(config, model, loaded.tokenizer, kernels, rotation, shard)
    pool_cfg = cfg if shard is None else shard_config(cfg, shard)
    if shard is not None and shard.replicated_kv:
        logger.warning("kvserve: %d KV heads over %d ranks: each KV head is replicated on %d ranks",
                       cfg.num_kv_heads, world, world // cfg.num_kv_heads)
    groups = KVGroups.of(cfg.layer_windows, hybrid=not config.cache.disable_hybrid_kv_cache)
    if groups.hybrid:
        logger.info("kvserve: hybrid KV cache, %d groups of %d layers (%s)", len(groups.groups),
                    groups.layers_per_block, groups.describe())
    sizes = config.kv_sizes(pool_cfg, groups.layers_per_block)
    num_blocks = _num_blocks(config, sizes, max_model_len)
    num_host_blocks = config.cache.offload_bytes // sizes.block_bytes if config.cache.cache_mode == "paged" else 0
    pool = make_pool(config, pool_cfg, num_blocks, formats, sizes.staging_slots, num_host_blocks, device,
                     groups.layers_per_block)
    remote: BlockTier | None = None
    if config.cache.kv_remote is not None:
        remote = RemoteKVTier(config.cache.kv_remote, remote_namespace(model, config, formats),
                              block_nbytes(pool.block_tensors), timeout_s=config.cache.kv_remote_timeout,
                              secret=config.cache.kv_remote_secret, events=_tier_events(config, REDIS))
    elif config.cache.kv_disk_dir is not None:
        remote = DiskKVTier(config.cache.kv_disk_dir, remote_namespace(model, config, formats),
                            block_nbytes(pool.block_tensors), config.cache.disk_tier_bytes,
                            events=_tier_events(config, DISK))
        opened.append(remote)
    # The baselines stand for engines without sharing: no prefix cache for them.
    block_manager = BlockManager(num_blocks, config.cache.block_size,
                                 config.cache.enable_prefix_caching and config.cache.cache_mode == "paged",
                                 num_host_blocks, remote, tuple(g.spec for g in groups.groups),
                                 max_num_batched_tokens if chunked_prefill else None,
                                 sizes.staging_slots, config.residual_tokens,
                                 events_medium=_event_medium(config, device))
    swap = None
    if config.scheduler.preemption_mode != "recompute" and config.cache.cache_mode == "paged":
        swap = _swap_space(config, pool, sizes.block_bytes)
    cost = PreemptionCost(config.scheduler.preemption_mode, sum(p.numel() for p in model.parameters()), device.type,
                          pool.nbytes // num_blocks, block_manager.blocks_for)
    contiguous = config.cache.cache_mode == "contiguous"
    scheduler = Scheduler(block_manager, config.scheduler.max_num_seqs, max_num_batched_tokens,
                          reserve_tokens=max_model_len if contiguous else 0,
                          recompute_all=config.cache.cache_mode == "no-cache",
                          swap=swap, prefer_swap=cost.prefer_swap, chunked_prefill=chunked_prefill,
                          drafts=draft_policy(config, max_model_len))
    backend = make_backend(config.runtime.attention_backend, pool, pool_cfg.num_heads, device,
                           windowed=bool(cfg.sliding_layers), softcap=cfg.attn_logit_softcapping)
    tp = None
    if shard is not None:
        tp = TPGroup.start(config, num_blocks, tp_worker_main)
        model = shard_model(model, shard, tp.group)
    runner = ModelRunner(model, pool, device, backend, kernels, swap, rotation, tp,
                         _graph_shape(config, device, tp, backend, max_model_len, groups),
                         cpu_stack=config.runtime.cpu_fused_step and device.type == "cpu" and tp is None,
                         layer_map=groups.layer_map(cfg.num_layers) if groups.hybrid else None)
    # Where the host's step is a large share of a short device step (CUDA); on a CPU the host and
    # the model share the cores, and a step's tokens are read a step late for nothing.
    # Speculation needs each step's tokens on the host before the next is scheduled: its drafts
    # continue them (EngineConfig refuses async_scheduling='on' with it).
    async_scheduling = config.scheduler.async_scheduling == "on" or (
        config.scheduler.async_scheduling == "auto" and device.type == "cuda" and tp is None
        and config.speculative.speculative is None)
    if async_scheduling:
        logger.info("kvserve: async scheduling: each step launches before the host reads the tokens of the one "
                    "before")
    tokenizer = loaded.tokenizer
    return EngineParts(config, device, model, cfg, loaded.name, tokenizer,
                       tokenizer.eos_token_id if tokenizer is not None else cfg.eos_token_id,
                       max_model_len, max_num_batched_tokens,
                       sizes.block_bytes * cfg.num_layers / (groups.layers_per_block * config.cache.block_size), groups,
                       pool, remote, block_manager, swap, scheduler, backend, tp, runner, async_scheduling,
                       _event_publisher(config, remote))


def _step_budget(config: EngineConfig, max_model_len: int, chunked_prefill: bool) -> int:
    tokens = config.tokens_per_step(max_model_len)
    if chunked_prefill and tokens < config.scheduler.max_num_seqs:
        raise ValueError(f"EngineConfig.max_num_batched_tokens ({tokens}) must be >= max_num_seqs "
                         f"({config.scheduler.max_num_seqs}) so that every running sequence decodes each step")
    if not chunked_prefill and tokens < max_model_len:
        raise ValueError(f"EngineConfig.max_num_batched_tokens ({tokens}) must be >= max_model_len "
                         f"({max_model_len}) so that any prompt can be prefilled (or enable_chunked_prefill)")
    return tokens


def _num_blocks(config: EngineConfig, sizes: KVSizes, max_model_len: int) -> int:
    budget = config.kv_budget_bytes()
    num_blocks = config.cache.num_blocks_override or (budget - sizes.staging_bytes) // sizes.block_bytes
    if num_blocks < 1:
        raise ValueError(f"EngineConfig.kv_cache_memory: {budget} bytes is smaller than one KV block "
                         f"({sizes.block_bytes} bytes = {config.cache.block_size} tokens"
                         + (f", after {sizes.staging_bytes} bytes of full-precision staging)"
                            if sizes.staging_bytes else ")"))
    if config.cache.cache_mode == "contiguous" and -(-max_model_len // config.cache.block_size) > num_blocks:
        raise ValueError(f"EngineConfig.kv_cache_memory: contiguous mode preallocates max_model_len "
                         f"({max_model_len}) tokens per sequence, more than the "
                         f"{num_blocks * config.cache.block_size} slots the budget holds")
    return num_blocks


def _swap_space(config: EngineConfig, pool: KVPool | QuantizedKVPool, block_bytes: int) -> SwapSpace:
    host, disk = config.cache.swap_bytes()
    try:
        return SwapSpace(pool, host // block_bytes, disk // block_bytes,
                         config.cache.swap_dir)
    except OSError as err:  # the file tier's space, reserved now so that no swap-out finds the disk full
        directory = config.cache.swap_dir or tempfile.gettempdir()
        free = shutil.disk_usage(directory).free
        raise ValueError(f"EngineConfig.disk_swap_memory: cannot reserve {disk} bytes for the swap file in "
                         f"{directory} ({err.strerror}; {free} bytes ({free / 2**20:.1f} MiB) free there): "
                         f"lower disk_swap_memory or set swap_dir to a larger filesystem") from None


def _graph_shape(config: EngineConfig, device: torch.device, tp: TPGroup | None, backend: AttentionBackend,
                 max_model_len: int, groups: KVGroups) -> tuple[int, int] | None:
    """(sequences, slots) of the decode steps to capture in CUDA graphs, or None (eager)."""
    if not config.runtime.cuda_graphs or device.type != "cuda":
        return None
    reason = "tensor parallelism" if tp is not None else "the hybrid KV cache's groups" if groups.hybrid else \
        backend.graph_unsupported()
    if reason is not None:
        logger.info("kvserve: decode steps run eagerly, without CUDA graphs: %s", reason)
        return None
    return config.scheduler.max_num_seqs, max_model_len


def draft_policy(config: EngineConfig, max_model_len: int) -> DraftPolicy | None:
    spec = config.speculative
    if spec.speculative is None:
        return None
    return DraftPolicy(NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max),
                       spec.speculative_disable_by_batch_size, max_model_len)


def _event_medium(config: EngineConfig, device: torch.device) -> str | None:
    """The KV events' name for the device pool (vLLM's "GPU"), or None when none are published."""
    if config.kv_events.kv_events_publisher == "null":
        return None
    return "GPU" if device.type == "cuda" else device.type.upper()


def _tier_events(config: EngineConfig, medium: str) -> TierEvents | None:
    """Where a lower tier records its KV events, or None when none are published."""
    if config.kv_events.kv_events_publisher == "null":
        return None
    return TierEvents(medium, config.cache.block_size)


def _event_publisher(config: EngineConfig, tier: BlockTier | None) -> ZmqEventPublisher | None:
    events = config.kv_events
    if events.kv_events_publisher == "null":
        return None
    publisher = ZmqEventPublisher(events.kv_events_endpoint, events.kv_events_replay_endpoint,
                                  events.kv_events_buffer_steps, events.kv_events_topic)
    # What the tier holds from before this engine (a disk tier's files), right after the first
    # batch's AllBlocksCleared, so a router knows it before any request runs.
    if tier is not None and tier.events is not None and (found := tier.events.take()):
        publisher.publish(found)
    return publisher
