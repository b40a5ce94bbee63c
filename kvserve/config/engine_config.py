"""The engine's configuration: its parts (model, cache, KV format, KV events, eviction,
scheduler, speculative, parallel, runtime), each validated on its own construction, and the
checks that span parts, run when they are put together. `EngineConfig.of(**options)` takes every
option by its flat name, as `LLM(...)` and the command line give them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.cache.kv_pool import KVPool
from kvserve.cache.kv_sizes import KVSizes
from kvserve.config.cache_options import CacheOptions
from kvserve.config.eviction_options import EvictionOptions
from kvserve.config.format_options import FormatPair, KVFormatOptions
from kvserve.config.kv_events_options import KVEventsOptions
from kvserve.config.model_options import ModelOptions
from kvserve.config.options import Options, option_fields
from kvserve.config.runtime_options import ParallelOptions, RuntimeOptions
from kvserve.config.scheduler_options import CHUNKED_BATCHED_TOKENS, SchedulerOptions
from kvserve.config.speculative_options import SpeculativeOptions
from kvserve.eviction.policy import EvictionPolicy
from kvserve.model.config import ModelConfig
from kvserve.validate import FieldError

# The parts, in the order the command line shows them, each an attribute of EngineConfig.
PARTS: dict[str, type[Options]] = {
    "model": ModelOptions, "cache": CacheOptions, "kv_format": KVFormatOptions, "kv_events": KVEventsOptions,
    "eviction": EvictionOptions,
    "scheduler": SchedulerOptions, "speculative": SpeculativeOptions, "parallel": ParallelOptions, "runtime": RuntimeOptions}
# Each option's part, by its flat name (a name belongs to one part: tests/test_config.py checks it).
PART_OF: dict[str, str] = {f.name: part for part, cls in PARTS.items() for f in option_fields(cls)}


@dataclass(frozen=True)
class EngineConfig:
    model: ModelOptions = field(default_factory=ModelOptions)
    cache: CacheOptions = field(default_factory=CacheOptions)
    kv_format: KVFormatOptions = field(default_factory=KVFormatOptions)
    kv_events: KVEventsOptions = field(default_factory=KVEventsOptions)
    eviction: EvictionOptions = field(default_factory=EvictionOptions)
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)
    speculative: SpeculativeOptions = field(default_factory=SpeculativeOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)

    @classmethod
    def of(cls, **options: Any) -> EngineConfig:
        """A configuration from options by their flat names (`block_size=32, kv_cache_dtype="int8"`)."""
        unknown = sorted(set(options) - set(PART_OF))
        if unknown:
            raise TypeError(f"EngineConfig: unknown option(s) {', '.join(unknown)}")
        parts = {part: {name: value for name, value in options.items() if PART_OF[name] == part} for part in PARTS}
        return cls(**{part: PARTS[part](**kwargs) for part, kwargs in parts.items()})

    def replace(self, **options: Any) -> EngineConfig:
        """This configuration with some options, by their flat names, changed."""
        return EngineConfig.of(**{**self.options(), **options})

    def options(self) -> dict[str, Any]:
        """Every option by its flat name."""
        return {name: getattr(getattr(self, part), name) for name, part in PART_OF.items()}

    def __post_init__(self) -> None:
        cache, scheduler = self.cache, self.scheduler
        # The baselines have no block tables to swap: refused, not silently ignored.
        if cache.cache_mode != "paged" and scheduler.preemption_mode != "recompute":
            raise FieldError("preemption_mode",
                             f"EngineConfig.preemption_mode={scheduler.preemption_mode!r} needs cache_mode='paged' "
                             f"(the {cache.cache_mode} baseline preempts by recompute)")
        formats = self.kv_formats()
        if formats is not None:  # swap and offload copy dense pages: a compressed pool has neither
            if scheduler.preemption_mode != "recompute":
                raise FieldError("preemption_mode", "EngineConfig.preemption_mode: compressed KV formats support "
                                                    "only 'recompute' preemption (swap copies dense pages)")
            if cache.offload_bytes:
                raise FieldError("offload_memory", "EngineConfig.offload_memory: offload needs dense pages; use "
                                                   "kv_cache_dtype='auto' with it")
        tier = "kv_remote" if cache.kv_remote is not None else "kv_disk_dir" if cache.kv_disk_dir is not None else None
        if tier is not None and not self._pages_whole(formats):
            raise FieldError(tier, f"EngineConfig.{tier}: blocks are kept as their pages: formats with a "
                                   f"full-precision window or encoded a block at a time (kivi, kv_residual > 0) "
                                   f"keep part of a block outside them")
        if self.parallel.tensor_parallel_size > 1:
            reason = self._tensor_parallel_unsupported()
            if reason:
                raise FieldError("tensor_parallel_size", f"EngineConfig.tensor_parallel_size: {reason}")
        if self.eviction.kv_eviction != "none":
            reason = self.eviction_unsupported()
            if reason:
                raise FieldError("kv_eviction", f"EngineConfig.kv_eviction: {reason}")
        if self.speculative.speculative is not None and (reason := self._speculation_unsupported(formats)):
            raise FieldError("speculative", f"EngineConfig.speculative={self.speculative.speculative!r}: {reason}")

    def _pages_whole(self, formats: list[FormatPair] | None) -> bool:
        """Every token's K/V lives in its block's pages: no full-precision window, no block coding."""
        return formats is None or (not self.residual_tokens and all(f.per_token for pair in formats for f in pair))

    def _speculation_unsupported(self, formats: list[FormatPair] | None) -> str | None:
        """What speculative decoding is not built with yet: a draft's rejected tokens must leave no
        trace, which these would need more than a released slot for (pages coded token by token
        need no more: a rejected token's codes sit past the context until overwritten)."""
        if not self._pages_whole(formats):
            return (f"kv_cache_dtype={self.kv_format.kv_cache_dtype!r} with kv_residual={self.residual_tokens} "
                    f"stages tokens in a full-precision window or encodes a block at a time (kivi), which would "
                    f"seal rejected draft tokens; use a format coded token by token (fp8, int8, int4) with "
                    f"kv_residual=0, or dense pages")
        if self.eviction.kv_eviction != "none":
            return "token eviction (kv_eviction) would score rejected tokens' attention"
        if self.cache.cache_mode != "paged":
            return f"it needs cache_mode='paged', not {self.cache.cache_mode!r}"
        if self.parallel.tensor_parallel_size > 1:
            return "tensor parallelism (tensor_parallel_size > 1) is not built with it"
        if self.scheduler.async_scheduling == "on":
            return "a draft continues the step before's tokens, which async_scheduling='on' reads a step late"
        return None

    def _tensor_parallel_unsupported(self) -> str | None:
        """What a first tensor-parallel engine leaves out: moves whose state lives on rank 0 only,
        and GPUs (the ranks' group is gloo; an NCCL group with a device per rank is not built)."""
        if self.model.torch_device.type != "cpu":
            return "runs on the CPU (gloo) for now; NCCL across GPUs is not built"
        if self.cache.cache_mode != "paged" or self.scheduler.preemption_mode != "recompute" or \
                self.cache.offload_bytes:
            return "needs cache_mode='paged', preemption_mode='recompute' and no offload_memory"
        if self.eviction.kv_eviction != "none":
            return "token eviction (kv_eviction) is not split across ranks yet"
        if self.cache.kv_remote is not None or self.cache.kv_disk_dir is not None:
            return "kv_remote and kv_disk_dir are not split across ranks yet"
        if self.scheduler.async_scheduling == "on":
            return "async_scheduling='on' is not built for ranks (peers would need the device's sampled tokens)"
        return None

    def eviction_policy(self, name: str | None = None, budget: int | None = None,
                        owner: str = "EngineConfig") -> EvictionPolicy | None:
        """The engine's policy with a request's overrides (errors name `owner`'s field); None for
        no eviction."""
        return self.eviction.policy(name, budget, owner, self.cache.block_size)

    def eviction_unsupported(self) -> str | None:
        """Why this engine cannot evict tokens (for the engine's policy or a request's), or None."""
        if self.cache.cache_mode != "paged":
            return "token eviction needs cache_mode='paged'"
        if self.cache.offload_bytes:
            return "token eviction does not combine with offload_memory (host blocks are not compacted)"
        if not self._pages_whole(self.kv_formats()):
            return ("token eviction needs per-token KV formats without a full-precision residual (fp8, int8, "
                    "int4, outlier, sparse with kv_residual=0); kivi pages are encoded a block at a time")
        return None

    def kv_format_names(self) -> list[tuple[str, str]]:
        return self.kv_format.format_names(self.model.torch_dtype)

    def kv_formats(self) -> list[FormatPair] | None:
        return self.kv_format.formats(self.model.torch_dtype)

    def kv_layer_formats(self, num_layers: int) -> list[FormatPair] | None:
        return self.kv_format.layer_formats(self.model.torch_dtype, num_layers)

    @property
    def residual_tokens(self) -> int:
        return self.kv_format.residual_tokens(self.model.torch_dtype)

    def kv_budget_bytes(self) -> int:
        return self.cache.budget_bytes(self.model.torch_device)

    def tokens_per_step(self, max_model_len: int) -> int:
        """max_num_batched_tokens, or its default for an engine whose context is max_model_len."""
        if self.scheduler.max_num_batched_tokens:
            return self.scheduler.max_num_batched_tokens
        # The baselines stand for engines without chunking: they prefill prompts whole.
        if self.scheduler.enable_chunked_prefill and self.cache.cache_mode == "paged":
            return CHUNKED_BATCHED_TOKENS.get(self.model.torch_device.type, CHUNKED_BATCHED_TOKENS["cpu"])
        return max(max_model_len, 2048)

    def kv_sizes(self, model: ModelConfig, layers_per_block: int | None = None) -> KVSizes:
        """What a pool of this configuration costs for `model` (cache/kv_sizes.py)."""
        return KVSizes.of(model, self.cache.block_size, self.model.torch_dtype,
                          self.kv_layer_formats(model.num_layers), self.scheduler.max_num_seqs, self.residual_tokens,
                          self.tokens_per_step(self.model.max_model_len or model.max_position), layers_per_block)

    def check_model(self, model: ModelConfig) -> None:
        """The checks that need the model's shape, run as soon as it is known; errors name the field."""
        if self.model.max_model_len is not None and self.model.max_model_len > model.max_position:
            raise FieldError("max_model_len", f"EngineConfig.max_model_len ({self.model.max_model_len}) exceeds the "
                                              f"model's context length ({model.max_position})")
        # An evicting sequence's slots no longer sit where a window counts positions back from.
        if model.sliding_layers and self.eviction.kv_eviction != "none":
            raise FieldError("kv_eviction", f"EngineConfig.kv_eviction={self.eviction.kv_eviction!r}: this model has "
                             f"sliding-window layers ({len(model.sliding_layers)} of {model.num_layers}), "
                             f"and eviction on them is not built; use kv_eviction='none'")
        self._check_hybrid(model)
        # Swap needs dense pages and one rank (checked above), so a block is a dense one.
        block = KVPool.bytes_per_block(model.num_layers, self.cache.block_size, model.num_kv_heads, model.head_dim,
                                       self.model.torch_dtype)
        if self.scheduler.preemption_mode != "recompute" and not any(n // block for n in self.cache.swap_bytes()):
            raise FieldError("host_swap_memory",
                             f"EngineConfig.host_swap_memory ({self.cache.host_swap_memory}) and disk_swap_memory "
                             f"({self.cache.disk_swap_memory}) hold no KV block ({block} bytes for this model): "
                             f"preemption_mode={self.scheduler.preemption_mode!r} could never swap; give a tier a "
                             f"block or more, or use preemption_mode='recompute'")
        for pair in self.kv_layer_formats(model.num_layers) or ():
            for fmt, role in zip(pair, ("k", "v")):
                group = fmt.layout.group_size
                if group and model.head_dim % group:
                    field = "kv_group_size" if getattr(self.kv_format, f"kv_group_size_{role}") is None else \
                        f"kv_group_size_{role}"
                    raise FieldError(field, f"EngineConfig.{field} ({group}) must divide the model's head_dim "
                                            f"({model.head_dim}) for {fmt.name} pages")

    def _check_hybrid(self, model: ModelConfig) -> None:
        """What the hybrid KV cache (sliding layers freeing out-of-window blocks) is not built for."""
        if not model.sliding_layers or self.cache.disable_hybrid_kv_cache:
            return
        # A pool tensor holds one layer of every group, so its pages need one format for all of
        # them, coded token by token (a staged block would be planned in one group's tables only),
        # and calibrated on no layer's own keys (the pool would encode every layer with the
        # calibration of the first group's layers: measured on Gemma 3, fp8_e4m3_fit's KL 0.012-0.018
        # against 0.0055-0.0080 calibrated per layer).
        formats, fmt = self.kv_formats(), self.kv_format
        shared = formats is None or (len(set(self.kv_format_names())) == 1 and self._pages_whole(formats)
                                     and not any(f.calibrated_per_layer for pair in formats for f in pair))
        refused = [(field, why) for field, why in (
            ("kv_cache_dtype", not shared and f"compressed pages staged, calibrated per layer or planned per layer "
                                              f"({fmt.kv_cache_dtype!r}, kv_residual={self.residual_tokens}, "
                                              f"kv_fp8_scales={fmt.kv_fp8_scales!r})"),
            ("preemption_mode", self.scheduler.preemption_mode != "recompute" and "preemption by swap"),
            ("offload_memory", self.cache.offload_bytes > 0 and "offload to host blocks"),
            ("kv_remote", self.cache.kv_remote is not None and "the remote tier"),
            ("kv_disk_dir", self.cache.kv_disk_dir is not None and "the disk tier"),
            ("tensor_parallel_size", self.parallel.tensor_parallel_size > 1 and "tensor parallelism"),
            ("cache_mode", self.cache.cache_mode != "paged" and f"cache_mode={self.cache.cache_mode!r}")) if why]
        if refused:
            field, why = refused[0]
            raise FieldError(field, f"EngineConfig.{field}: {why} is not built for the hybrid KV cache of this "
                                    f"model's sliding-window layers ({len(model.sliding_layers)} of "
                                    f"{model.num_layers}); set disable_hybrid_kv_cache=True (every layer keeps "
                                    f"every block) or leave {field} at its default")
