"""The engine's configuration in parts (model, cache, KV format, KV events, eviction, scheduler,
speculative, parallel, runtime), each a validated dataclass; `EngineConfig.of(**options)` builds
one from flat names."""
from kvserve.config.cache_options import CACHE_MODES, CacheOptions
from kvserve.config.engine_config import PART_OF, PARTS, EngineConfig
from kvserve.config.eviction_options import EvictionOptions
from kvserve.config.format_options import KVFormatOptions
from kvserve.config.kv_events_options import KVEventsOptions
from kvserve.config.model_options import DTYPES, ModelOptions
from kvserve.config.options import Options, opt, option_fields, parse_bytes
from kvserve.config.runtime_options import ParallelOptions, RuntimeOptions
from kvserve.config.scheduler_options import CHUNKED_BATCHED_TOKENS, SchedulerOptions
from kvserve.config.speculative_options import SpeculativeOptions

__all__ = ["CACHE_MODES", "CHUNKED_BATCHED_TOKENS", "DTYPES", "PARTS", "PART_OF", "CacheOptions", "EngineConfig",
           "EvictionOptions", "KVEventsOptions", "KVFormatOptions", "ModelOptions", "Options", "ParallelOptions", "RuntimeOptions",
           "SchedulerOptions", "SpeculativeOptions", "opt", "option_fields", "parse_bytes"]
