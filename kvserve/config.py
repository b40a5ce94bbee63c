"""The engine's configuration: one dataclass, validated on construction."""
from __future__ import annotations

import os
import re
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from kvserve.attention.selector import BACKEND_NAMES
from kvserve.attention.rotation import ROTATIONS
from kvserve.cache.formats import (FORMAT_CHOICES, FP8_SCALES, KVFormat, check_format_options, format_entry,
                                   format_names, make_format)
from kvserve.cache.kv_plan import KVPlan, plan_path
from kvserve.cache.kv_pool import KVPool
from kvserve.eviction.policy import POLICY_NAMES, EvictionPolicy
from kvserve.model.config import ModelConfig
from kvserve.model.cpu_linear import SMALL_BATCH
from kvserve.texts import TEXT_NAMES
from kvserve.validate import FieldError, is_int

REMOTE_SCHEMES = ("redis://", "rediss://", "unix://")

CACHE_MODES = ("paged", "contiguous", "no-cache")
ASYNC_SCHEDULING = ("auto", "on", "off")
PREEMPTION_MODES = ("recompute", "swap", "auto")
# Tokens per step when chunked prefill is on and max_num_batched_tokens is not set, by device: on
# a CPU a step's time grows with its tokens, so a small one keeps running streams moving; a GPU
# runs 8192 tokens (vLLM's default) in about the time of a few hundred, and a small budget would
# leave it idle.
CHUNKED_BATCHED_TOKENS = {"cpu": 512, "cuda": 8192}
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}
_DTYPE_FORMAT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15}
# Byte sizes given as strings only: a bare number is ambiguous (vLLM's swap_space counts GiB,
# kv_cache_memory takes a fraction of free memory).
_SIZE_FIELDS = ("host_swap_memory", "disk_swap_memory", "offload_memory")


# The parts of a configuration: each is shown as one group of command-line options, in this
# order, and each field belongs to exactly one (tests/test_config.py checks the partition).
CONFIG_PARTS: dict[str, tuple[str, ...]] = {
    "model": ("model", "dtype", "device", "max_model_len", "seed"),
    "cache": ("kv_cache_memory", "num_blocks_override", "block_size", "cache_mode", "enable_prefix_caching",
              "disable_hybrid_kv_cache", "host_swap_memory", "disk_swap_memory", "swap_dir", "offload_memory", "kv_remote",
              "kv_remote_timeout", "kv_remote_secret"),
    "KV format": ("kv_cache_dtype", "kv_cache_dtype_k", "kv_cache_dtype_v", "kv_rotation", "kv_rotate_keys",
                  "kv_group_size", "kv_group_size_k", "kv_group_size_v", "kv_residual", "kv_outliers",
                  "kv_sparse_threshold", "kv_sparse_capacity", "kv_fp8_scales", "kv_calibration_tokens",
                  "kv_calibration_data", "kv_exact_sink", "kv_key_wide_channels", "kv_symmetric_values"),
    "eviction": ("kv_eviction", "kv_budget", "kv_sink_tokens", "kv_window", "kv_stride", "kv_observation_window",
                 "kv_pooling_kernel", "kv_evict_during_decode", "kv_evict_interval", "kv_prefill_chunk",
                 "kv_mean_heads"),
    "scheduler": ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "preemption_mode",
                  "async_scheduling"),
    "parallel": ("tensor_parallel_size",),
    "runtime": ("attention_backend", "cpu_kernels", "cpu_fused_step", "cuda_graphs"),
}


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise FieldError("kv_cache_memory",
                         f"EngineConfig.kv_cache_memory: cannot parse {text!r} (use e.g. '2GiB' or 0.5)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")



def policy_for(owner: str, **fields: Any) -> EvictionPolicy:
    """An EvictionPolicy whose errors name `owner`'s fields (EngineConfig, SamplingParams)."""
    try:
        return EvictionPolicy(**fields)
    except FieldError as err:
        raise FieldError(err.field, str(err).replace("EvictionPolicy.", f"{owner}.", 1)) from None


def _opt(default: object, help: str, **cli: object) -> Any:
    """A field with the help text its command-line option shows (kvserve.engine_args derives them)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineConfig:
    model: str | Path | ModelConfig | None = _opt(
        None, "a .gguf file, a Hugging Face model directory, or random:<preset> (default: the bundled "
              "SmolLM2-135M-Instruct)")
    dtype: str = _opt("bfloat16", "model dtype", choices=sorted(DTYPES))
    device: str = _opt("auto", "auto (cuda if present), cpu, cuda or cuda:N")
    kv_cache_memory: str | float = _opt("2GiB", "KV pool size: bytes like 2GiB, or a fraction of free memory like 0.5")
    num_blocks_override: int | None = _opt(
        None, "device KV blocks to build, whatever kv_cache_memory holds (vLLM's num_gpu_blocks_override: a "
              "few blocks force preemption, for tests)")
    block_size: int = _opt(16, "tokens per KV block")
    max_num_seqs: int = _opt(32, "sequences per batch")
    max_num_batched_tokens: int | None = _opt(
        None, "tokens per step (default with chunked prefill: 512 on a CPU, 8192 on CUDA; without: "
              "max(max_model_len, 2048))")
    enable_chunked_prefill: bool = _opt(
        True, "cut prompts into chunks that run beside the decodes of running sequences, in one token "
              "budget per step (off: prefill whole prompts in steps of their own)")
    max_model_len: int | None = _opt(None, "context length (default: the model's)")
    cache_mode: str = _opt("paged", "paged; contiguous and no-cache are baselines", choices=CACHE_MODES)
    enable_prefix_caching: bool = _opt(True, "reuse the K/V of shared prompt prefixes (paged mode)")
    disable_hybrid_kv_cache: bool = _opt(
        False, "keep every block of a sliding-window layer (vLLM's disable_hybrid_kv_cache_manager): by default "
               "those layers hold only the blocks their window sees")
    preemption_mode: str = _opt("recompute", "when blocks run out: recompute, swap, or auto (the cheaper)",
                                choices=PREEMPTION_MODES)
    host_swap_memory: str = _opt("1GiB", "host tier for swapped blocks")
    disk_swap_memory: str = _opt("0", "file tier, used when the host tier is full; its space is reserved at "
                                      "start-up (refused when swap_dir has too little)")
    swap_dir: str | None = _opt(None, "where the file tier lives (default: the temp dir)")
    offload_memory: str = _opt("0", "host memory for the cold blocks of sequences longer than the device pool")
    # KV cache format (kvserve.cache.formats): "auto" stores K/V in the model dtype as computed;
    # a format name compresses the pages. Keys and values may differ.
    kv_cache_dtype: str = _opt("auto", "how K/V pages are stored: auto keeps the model dtype; a format name ("
                                       f"{', '.join(format_names())}) stores them in that format; plan:PATH "
                                       "reads a per-layer plan (JSON: {'version': 1, 'layers': [{'k': 'int8', "
                                       "'v': 'int4'}, ...]}), one entry per layer")
    kv_rotation: str = _opt("none", "rotate each head's q, k and v before the pages (QuaRot): spreads outlier "
                                    "channels so compressed pages lose less; hadamard (power-of-two head_dim) or "
                                    "random orthogonal", choices=ROTATIONS)
    kv_rotate_keys: bool = _opt(True, "with kv_rotation: false rotates values only, so keys keep their outlier "
                                      "channels in place for kv_key_wide_channels to find")
    kv_cache_dtype_k: str | None = _opt(None, "keys only (default: kv_cache_dtype)", choices=FORMAT_CHOICES)
    kv_cache_dtype_v: str | None = _opt(None, "values only (default: kv_cache_dtype)", choices=FORMAT_CHOICES)
    kv_group_size: int = _opt(32, "channels per scale/zero-point for int4, kivi values and outlier (4..128)")
    kv_group_size_k: int | None = _opt(None, "keys only (default: kv_group_size)")
    kv_group_size_v: int | None = _opt(None, "values only (default: kv_group_size)")
    kv_residual: int | None = _opt(None, "recent tokens kept in full precision (default: 128 with kivi, else 0)")
    kv_outliers: int = _opt(4, "exact entries per token and head for 'outlier'")
    kv_sparse_threshold: float = _opt(0.5, "'sparse' drops entries below this times the token-head RMS")
    kv_sparse_capacity: float = _opt(0.5, "'sparse' stores at most this fraction of head_dim per token-head")
    kv_fp8_scales: str = _opt("token", "fp8 pages: token stores a dynamic scale per token and KV head; head uses "
                                       "one fixed scale per layer and KV head (vLLM's per-head scales), "
                                       "calibrated at start-up on kv_calibration_tokens tokens of "
                                       "kv_calibration_data, and stores codes alone", choices=FP8_SCALES)
    kv_calibration_tokens: int = _opt(512, "tokens the start-up calibration reads (kv_fp8_scales=head, "
                                           "kv_key_wide_channels)")
    kv_calibration_data: str = _opt("calibration", "text the start-up calibration reads: calibration (bundled "
                                                   "with kvserve, read by no evaluation), python-docs, wikitext2 "
                                                   "or a file path; kvserve eval refuses --data that overlaps it")
    kv_exact_sink: bool = _opt(False, "kivi keys: each block keeps its first key in fp16, outside the block's "
                                      "channel ranges, so a sequence's first token (the attention sink every "
                                      "query reads) is exact and cannot stretch its block's ranges; costs "
                                      "16 / block_size bits per key value")
    kv_key_wide_channels: int = _opt(0, "kivi keys: this many channels per KV head (a multiple of 8; whole RoPE "
                                        "pairs) get one bit more, those with the largest E[q^2] * E[range^2], "
                                        "chosen at start-up on kv_calibration_tokens tokens; costs that many bits "
                                        "per key; pair with kv_rotate_keys=false")
    kv_symmetric_values: bool = _opt(False, "kivi values: codes symmetric about zero with a scale and no "
                                            "zero-point, 16 bits per group fewer; best with rotated values")
    # Token eviction (kvserve.eviction): each sequence keeps kv_budget tokens; requests may override.
    kv_eviction: str = _opt("none", "drop cached tokens once a sequence holds kv_budget: window (sinks + recent, "
                                    "StreamingLLM), h2o (heavy hitters), snapkv (scored by the prompt's last "
                                    "queries), tova (lowest attention of the newest query), strided (every "
                                    "kv_stride-th old token); none keeps all", choices=POLICY_NAMES)
    kv_budget: int | None = _opt(None, "tokens each sequence keeps per KV head with kv_eviction (required with it); "
                                       "with kv_eviction none, the budget of requests that pick a policy and no "
                                       "budget of their own")
    kv_sink_tokens: int = _opt(4, "first tokens window and strided always keep")
    kv_window: int | None = _opt(None, "recent tokens h2o and strided always keep (default kv_budget // 2)")
    kv_stride: int = _opt(4, "strided keeps old tokens at positions divisible by this")
    kv_observation_window: int = _opt(32, "snapkv: queries whose attention ranks tokens (and recent tokens kept)")
    kv_pooling_kernel: int = _opt(5, "snapkv: positions its scores are averaged over (odd)")
    kv_evict_during_decode: bool = _opt(True, "keep each sequence at kv_budget at every step (off: evict once, "
                                              "when the prompt ends, as kvpress does, and let the cache grow)")
    kv_evict_interval: int | None = _opt(None, "during decode, evict once a sequence holds this many tokens past "
                                               "kv_budget (default block_size: a block freed per compaction; 1: "
                                               "every step)")
    kv_prefill_chunk: int | None = _opt(None, "evict within prompts: run them this many tokens at a time and cut "
                                              "back to kv_budget after each chunk, so a long prompt holds "
                                              "kv_budget + this many slots, not its length (default: a prompt is "
                                              "judged whole when it ends, as kvpress does)")
    kv_mean_heads: bool = _opt(False, "h2o, snapkv, tova: keep one set of tokens per layer, ranked by attention "
                                      "averaged over its heads (TOVA's paper, kvpress), not one set per KV head")
    kv_remote: str | None = _opt(None, "a Redis or Valkey URL (redis://host:port/db) holding full prefix blocks "
                                       "shared by every engine that uses it: blocks are written when they join "
                                       "the prefix cache and read on a local prefix miss")
    kv_remote_timeout: float = _opt(0.25, "seconds a kv_remote reply may take; a slower or failed one turns the "
                                          "tier off for 10 s (a warning; the blocks are computed instead)")
    # Never shown: not in the repr, logs, errors or /metrics.
    kv_remote_secret: str | None = field(default=None, repr=False, metadata={"help": (
        "a secret shared by the engines of one kv_remote: each value then carries a keyed BLAKE2b MAC of its key "
        "and pages, so values written without it (by anyone else who can write to the Redis server) are refused, "
        "and engines with another secret share nothing (on the command line it shows in the process list)")})
    tensor_parallel_size: int = _opt(1, "ranks to split the model over (attention heads and KV heads, MLP "
                                        "columns), each a process kvserve spawns, over torch.distributed (gloo, "
                                        "on the CPU); each rank's pool holds only its KV heads")
    attention_backend: str = _opt(
        "auto", "auto: the fastest backend that serves the configuration (cpu: a C++ kernel reading pages "
                "in place; triton: Triton kernels, on CUDA); torch: the gather + SDPA reference",
        choices=BACKEND_NAMES)
    cpu_kernels: bool = _opt(True, "fused C++ ops and the bf16 small-batch linear on CPU (built once, cached); "
                                   "off: eager torch")
    cpu_fused_step: bool = _opt(True, f"run CPU steps of up to {SMALL_BATCH} tokens through the whole decoder "
                                      "stack in one C++ call, bit for bit the layered model (bf16 with the "
                                      "small-batch linear: AVX512-BF16 or AVX2; cpu backend; uncompressed pages "
                                      "or int8 / fp8 / int4 codes with no residual; no KV rotation; one rank); "
                                      "off: layer by layer from Python")
    cuda_graphs: bool = _opt(True, "replay decode steps from CUDA graphs, one per batch-size bucket up to "
                                   "max_num_seqs, captured at start-up (CUDA, triton backend, uncompressed "
                                   "pages); off: every step launches its kernels eagerly")
    async_scheduling: str = _opt("auto", "launch each step before reading the tokens of the one before, so the "
                                         "host's bookkeeping (stop checks, detokenizing, scheduling) runs while "
                                         "the device computes; auto: on for CUDA, off on a CPU (where the host "
                                         "and the model share the cores); requests with beams, n > 1, logprobs, "
                                         "penalties, logit_bias, forced tokens or eviction step synchronously",
                                 choices=ASYNC_SCHEDULING)
    # Sampling has its own --seed; this one seeds random weights and unseeded requests.
    seed: int = _opt(0, "seeds random-weight models and requests without a seed", flag="engine-seed")

    def __post_init__(self) -> None:
        self._check_types()
        if self.dtype not in DTYPES:
            raise FieldError("dtype", f"EngineConfig.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            raise FieldError("device", f"EngineConfig.device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda"):
            self._check_cuda()
        if self.cache_mode not in CACHE_MODES:
            raise FieldError("cache_mode",
                             f"EngineConfig.cache_mode must be one of {CACHE_MODES}, got {self.cache_mode!r}")
        for name in ("block_size", "max_num_seqs"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise FieldError(name, f"EngineConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("max_num_batched_tokens", "max_model_len", "num_blocks_override"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise FieldError(name, f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.kv_cache_memory, str) and not 0 < self.kv_cache_memory <= 1:
            raise FieldError("kv_cache_memory",
                             f"EngineConfig.kv_cache_memory as a fraction must be in (0, 1], "
                             f"got {self.kv_cache_memory}")
        if isinstance(self.kv_cache_memory, str):
            parse_bytes(self.kv_cache_memory)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise FieldError("preemption_mode",
                             f"EngineConfig.preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {self.preemption_mode!r}")
        for name in _SIZE_FIELDS:
            try:
                parse_bytes(getattr(self, name))
            except ValueError:
                raise FieldError(name, f"EngineConfig.{name}: cannot parse {getattr(self, name)!r}") from None
        if self.swap_dir is not None and not (os.path.isdir(self.swap_dir) and os.access(self.swap_dir, os.W_OK)):
            why = "is not a writable directory" if os.path.exists(self.swap_dir) else "does not exist"
            raise FieldError("swap_dir", f"EngineConfig.swap_dir: {self.swap_dir!r} {why}")
        # The baselines have no block tables to swap or offload: refused, not silently ignored.
        if self.cache_mode != "paged" and self.preemption_mode != "recompute":
            raise FieldError("preemption_mode",
                             f"EngineConfig.preemption_mode={self.preemption_mode!r} needs cache_mode='paged' "
                             f"(the {self.cache_mode} baseline preempts by recompute)")
        if self.cache_mode != "paged" and parse_bytes(self.offload_memory):
            raise FieldError("offload_memory",
                             f"EngineConfig.offload_memory needs cache_mode='paged' (got {self.cache_mode!r})")
        if self.attention_backend not in BACKEND_NAMES:
            raise FieldError("attention_backend",
                             f"EngineConfig.attention_backend must be one of {BACKEND_NAMES}, "
                             f"got {self.attention_backend!r}")
        if self.async_scheduling not in ASYNC_SCHEDULING:
            raise FieldError("async_scheduling",
                             f"EngineConfig.async_scheduling must be one of {ASYNC_SCHEDULING}, "
                             f"got {self.async_scheduling!r}")
        formats = self._check_kv_format()
        self._check_parallel()
        self._check_remote(formats)
        self._check_tiers(formats)
        if self.kv_rotation not in ROTATIONS:
            raise FieldError("kv_rotation",
                             f"EngineConfig.kv_rotation must be one of {', '.join(ROTATIONS)}, "
                             f"got {self.kv_rotation!r}")
        self._check_eviction()

    def _check_types(self) -> None:
        """Each field holds a value of its annotated type, checked first so that the checks below
        may rely on it: a flag given as "no" or a count given as True would pass them."""
        for name, allowed in _FIELD_TYPES.items():
            value = getattr(self, name)
            if not any(_is_a(value, t) for t in allowed):
                names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
                got = f"a value of type {type(value).__name__}" if name in _HIDDEN else repr(value)
                if name in _SIZE_FIELDS:
                    names, got = "a size string such as '4GiB', '512MiB' or '0'", f"{got} of type {type(value).__name__}"
                raise FieldError(name, f"EngineConfig.{name} must be {names}, got {got}")

    def _check_cuda(self) -> None:
        if not torch.cuda.is_available():
            why = "this torch has no CUDA" if torch.version.cuda is None else "no GPU is visible"
            raise FieldError("device", f"EngineConfig.device is {self.device!r} but {why}; use 'cpu' or 'auto'")
        index = torch.device(self.device).index
        if index is not None and index >= torch.cuda.device_count():
            raise FieldError("device",
                             f"EngineConfig.device is {self.device!r} but only {torch.cuda.device_count()} "
                             f"GPU(s) are visible")

    def eviction_policy(self, name: str | None = None, budget: int | None = None,
                        owner: str = "EngineConfig") -> EvictionPolicy | None:
        """The engine's policy with a request's overrides (errors name `owner`'s field); None
        for no eviction."""
        name = self.kv_eviction if name is None else name
        if name == "none":
            if budget is not None:  # a request's budget alone would be ignored without a word
                raise FieldError("kv_budget", f"{owner}.kv_budget has no effect without kv_eviction (this one: 'none')")
            return None
        budget = self.kv_budget if budget is None else budget
        if budget is None:
            raise FieldError("kv_budget", f"{owner}.kv_budget is required with kv_eviction={name!r}")
        return self._policy(owner, name, budget)

    def _policy(self, owner: str, name: str, budget: int) -> EvictionPolicy:
        """`name` at `budget` with this engine's eviction knobs."""
        return policy_for(owner, name=name, budget=budget, sink_tokens=self.kv_sink_tokens, window=self.kv_window,
                          stride=self.kv_stride, observation_window=self.kv_observation_window,
                          pooling_kernel=self.kv_pooling_kernel, during_decode=self.kv_evict_during_decode,
                          mean_heads=self.kv_mean_heads, prefill_chunk=self.kv_prefill_chunk,
                          interval=self.block_size if self.kv_evict_interval is None else self.kv_evict_interval)

    def _check_eviction(self) -> None:
        if self.kv_eviction not in POLICY_NAMES:
            raise FieldError("kv_eviction",
                             f"EngineConfig.kv_eviction must be one of {', '.join(POLICY_NAMES)}, "
                             f"got {self.kv_eviction!r}")
        if self.kv_budget is not None and (not is_int(self.kv_budget) or self.kv_budget < 1):
            raise FieldError("kv_budget", f"EngineConfig.kv_budget must be a positive integer, got {self.kv_budget!r}")
        # Knobs are checked whenever set, though only a policy reads them: a request may pick one.
        self._policy("EngineConfig", "none", 1)
        self.eviction_policy()
        if self.kv_eviction != "none":
            reason = self.eviction_unsupported()
            if reason:
                raise FieldError("kv_eviction", f"EngineConfig.kv_eviction: {reason}")

    def eviction_unsupported(self) -> str | None:
        """Why this engine cannot evict tokens (for the engine's policy or a request's), or None."""
        if self.cache_mode != "paged":
            return "token eviction needs cache_mode='paged'"
        if parse_bytes(self.offload_memory):
            return "token eviction does not combine with offload_memory (host blocks are not compacted)"
        formats = self.kv_formats()
        if formats is not None and (self.residual_tokens or not all(f.per_token for pair in formats for f in pair)):
            return ("token eviction needs per-token KV formats without a full-precision residual (fp8, int8, "
                    "int4, outlier, sparse with kv_residual=0); kivi pages are encoded a block at a time")
        return None

    def _check_kv_format(self) -> list[tuple[KVFormat, KVFormat]] | None:
        """The format fields; returns the layers' formats (None: pages as computed)."""
        for name in ("kv_cache_dtype", "kv_cache_dtype_k", "kv_cache_dtype_v"):
            value = getattr(self, name)
            if name == "kv_cache_dtype" and isinstance(value, str) and plan_path(value) is not None:
                if self.kv_cache_dtype_k or self.kv_cache_dtype_v:
                    raise FieldError("kv_cache_dtype_k",
                                     "EngineConfig.kv_cache_dtype_k / kv_cache_dtype_v: a plan (kv_cache_dtype="
                                     "'plan:...') names each layer's formats; drop the role overrides")
                continue
            if value is not None and value != "auto" and value not in FORMAT_CHOICES:
                plan = ", 'plan:PATH' (a tune-kv plan)" if name == "kv_cache_dtype" else ""
                raise FieldError(name,
                                 f"EngineConfig.{name} must be 'auto'{plan} or one of {', '.join(FORMAT_CHOICES)}, "
                                 f"got {value!r}")
        try:
            check_format_options(self.kv_group_size, self.kv_outliers, self.kv_sparse_threshold,
                                 self.kv_sparse_capacity, self.kv_fp8_scales, self.kv_key_wide_channels)
        except FieldError as err:
            raise FieldError(err.field, f"EngineConfig.{err}") from None
        if not (is_int(self.kv_calibration_tokens) and self.kv_calibration_tokens >= 1):
            raise FieldError("kv_calibration_tokens",
                             f"EngineConfig.kv_calibration_tokens must be an integer >= 1, got "
                             f"{self.kv_calibration_tokens!r}")
        if self.kv_calibration_data not in TEXT_NAMES and not Path(self.kv_calibration_data).is_file():
            raise FieldError("kv_calibration_data",
                             f"EngineConfig.kv_calibration_data must be one of {', '.join(TEXT_NAMES)} or a file, "
                             f"got {self.kv_calibration_data!r}")
        if self.kv_residual is not None and (not is_int(self.kv_residual) or self.kv_residual < 0):
            raise FieldError("kv_residual",
                             f"EngineConfig.kv_residual must be an integer >= 0, got {self.kv_residual!r}")
        try:
            formats = self.kv_formats()
        except FieldError as err:
            raise FieldError(err.field, f"EngineConfig.{err}") from None
        except ValueError as err:  # a plan file's or a format's own error
            raise FieldError("kv_cache_dtype", f"EngineConfig.kv_cache_dtype: {err}") from None
        return formats

    def _check_parallel(self) -> None:
        if not (is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1):
            raise FieldError("tensor_parallel_size",
                             f"EngineConfig.tensor_parallel_size must be an integer >= 1, got "
                             f"{self.tensor_parallel_size!r}")
        if self.tensor_parallel_size > 1:
            reason = self._tensor_parallel_unsupported()
            if reason:
                raise FieldError("tensor_parallel_size", f"EngineConfig.tensor_parallel_size: {reason}")

    def _check_remote(self, formats: list[tuple[KVFormat, KVFormat]] | None) -> None:
        if self.kv_remote is not None:
            reason = self._remote_unsupported(formats)
            if reason:
                raise FieldError("kv_remote", f"EngineConfig.kv_remote: {reason}")
        if self.kv_remote_secret is not None and (self.kv_remote is None or not self.kv_remote_secret):
            raise FieldError("kv_remote_secret",
                             "EngineConfig.kv_remote_secret must be a non-empty string, used with kv_remote")
        if not (isinstance(self.kv_remote_timeout, (int, float)) and self.kv_remote_timeout > 0):
            raise FieldError("kv_remote_timeout",
                             f"EngineConfig.kv_remote_timeout must be a number of seconds > 0, got "
                             f"{self.kv_remote_timeout!r}")

    def _check_tiers(self, formats: list[tuple[KVFormat, KVFormat]] | None) -> None:
        """Swap and offload copy dense pages: a compressed pool has neither."""
        if formats is not None:
            if self.preemption_mode != "recompute":
                raise FieldError("preemption_mode",
                                 "EngineConfig.preemption_mode: compressed KV formats support only "
                                 "'recompute' preemption (swap copies dense pages)")
            if parse_bytes(self.offload_memory):
                raise FieldError("offload_memory",
                                 "EngineConfig.offload_memory: offload needs dense pages; use "
                                 "kv_cache_dtype='auto' with it")

    def _tensor_parallel_unsupported(self) -> str | None:
        """What a first tensor-parallel engine leaves out: moves whose state lives on rank 0 only,
        and GPUs (the ranks' group is gloo; an NCCL group with a device per rank is not built)."""
        if self.torch_device.type != "cpu":
            return "runs on the CPU (gloo) for now; NCCL across GPUs is not built"
        if self.cache_mode != "paged" or self.preemption_mode != "recompute" or parse_bytes(self.offload_memory):
            return "needs cache_mode='paged', preemption_mode='recompute' and no offload_memory"
        if self.kv_eviction != "none":
            return "token eviction (kv_eviction) is not split across ranks yet"
        if self.kv_remote is not None:
            return "kv_remote is not split across ranks yet"
        if self.async_scheduling == "on":
            return "async_scheduling='on' is not built for ranks (peers would need the device's sampled tokens)"
        return None

    def _remote_unsupported(self, formats: list[tuple[KVFormat, KVFormat]] | None) -> str | None:
        if not (isinstance(self.kv_remote, str) and self.kv_remote.startswith(REMOTE_SCHEMES)):
            return f"must be a URL starting with {' or '.join(REMOTE_SCHEMES)}, got {self.kv_remote!r}"
        if self.cache_mode != "paged" or not self.enable_prefix_caching:
            return "the remote tier extends the prefix cache: it needs cache_mode='paged' and enable_prefix_caching"
        if formats is not None and (self.residual_tokens or not all(f.per_token for pair in formats for f in pair)):
            return ("blocks are shared as their pages: formats with a full-precision window or encoded a block at "
                    "a time (kivi, kv_residual > 0) keep part of a block outside them")
        return None

    def kv_format_names(self) -> list[tuple[str, str]]:
        """(keys, values) format names, 'auto' resolved to the model dtype: a plan's, one pair
        per layer, or one pair for every layer."""
        auto = _DTYPE_FORMAT[self.torch_dtype]
        path = plan_path(self.kv_cache_dtype)
        if path is not None:
            pairs = list(KVPlan.load(path).layers)
        else:
            base = auto if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
            pairs = [(self.kv_cache_dtype_k or base, self.kv_cache_dtype_v or base)]
        return [(auto if k == "auto" else k, auto if v == "auto" else v) for k, v in pairs]

    def kv_formats(self) -> list[tuple[KVFormat, KVFormat]] | None:
        """The (keys, values) formats of a compressed pool, as `kv_format_names` lists them; None
        when every page holds the model dtype."""
        auto = _DTYPE_FORMAT[self.torch_dtype]
        pairs = self.kv_format_names()
        if all(pair == (auto, auto) for pair in pairs):
            return None
        return [self._format_pair(pair) for pair in pairs]

    def check_model(self, model: ModelConfig) -> None:
        """The checks that need the model's shape, run as soon as it is known; errors name the field."""
        if self.max_model_len is not None and self.max_model_len > model.max_position:
            raise FieldError("max_model_len",
                             f"EngineConfig.max_model_len ({self.max_model_len}) exceeds the model's "
                             f"context length ({model.max_position})")
        # An evicting sequence's slots no longer sit where a window counts positions back from.
        if model.sliding_layers and self.kv_eviction != "none":
            raise FieldError("kv_eviction", f"EngineConfig.kv_eviction={self.kv_eviction!r}: this model has "
                             f"sliding-window layers ({len(model.sliding_layers)} of {model.num_layers}), "
                             f"and eviction on them is not built; use kv_eviction='none'")
        self._check_hybrid(model)
        # Swap needs dense pages and one rank (checked above), so a block is a dense one.
        block = KVPool.bytes_per_block(model.num_layers, self.block_size, model.num_kv_heads, model.head_dim,
                                       self.torch_dtype)
        if self.preemption_mode != "recompute" and not any(parse_bytes(getattr(self, f)) // block for f in
                                                           ("host_swap_memory", "disk_swap_memory")):
            raise FieldError("host_swap_memory",
                             f"EngineConfig.host_swap_memory ({self.host_swap_memory}) and disk_swap_memory "
                             f"({self.disk_swap_memory}) hold no KV block ({block} bytes for this model): "
                             f"preemption_mode={self.preemption_mode!r} could never swap; give a tier a block "
                             f"or more, or use preemption_mode='recompute'")
        for pair in self.kv_layer_formats(model.num_layers) or ():
            for fmt, role in zip(pair, ("k", "v")):
                group = fmt.layout.group_size
                if group and model.head_dim % group:
                    field = "kv_group_size" if getattr(self, f"kv_group_size_{role}") is None else \
                        f"kv_group_size_{role}"
                    raise FieldError(field,
                                     f"EngineConfig.{field} ({group}) must divide the model's head_dim "
                                     f"({model.head_dim}) for {fmt.name} pages")

    def _check_hybrid(self, model: ModelConfig) -> None:
        """What the hybrid KV cache (sliding layers freeing out-of-window blocks) is not built for."""
        if not model.sliding_layers or self.disable_hybrid_kv_cache:
            return
        # A pool tensor holds one layer of every group, so its pages need one format for all of
        # them, coded token by token (a staged block would be planned in one group's tables only).
        formats = self.kv_formats()
        shared = formats is None or (len(set(self.kv_format_names())) == 1 and not self.residual_tokens
                                     and all(f.per_token for f in formats[0]) and self.kv_fp8_scales != "head")
        refused = [(field, why) for field, why in (
            ("kv_cache_dtype", not shared and f"compressed pages staged, calibrated per head or planned per layer "
                                              f"({self.kv_cache_dtype!r}, kv_residual={self.residual_tokens}, "
                                              f"kv_fp8_scales={self.kv_fp8_scales!r})"),
            ("preemption_mode", self.preemption_mode != "recompute" and "preemption by swap"),
            ("offload_memory", parse_bytes(self.offload_memory) > 0 and "offload to host blocks"),
            ("kv_remote", self.kv_remote is not None and "the remote tier"),
            ("tensor_parallel_size", self.tensor_parallel_size > 1 and "tensor parallelism"),
            ("cache_mode", self.cache_mode != "paged" and f"cache_mode={self.cache_mode!r}")) if why]
        if refused:
            field, why = refused[0]
            raise FieldError(field, f"EngineConfig.{field}: {why} is not built for the hybrid KV cache of this "
                                    f"model's sliding-window layers ({len(model.sliding_layers)} of "
                                    f"{model.num_layers}); set disable_hybrid_kv_cache=True (every layer keeps "
                                    f"every block) or leave {field} at its default")

    def kv_layer_formats(self, num_layers: int) -> list[tuple[KVFormat, KVFormat]] | None:
        """`kv_formats` for each of a model's `num_layers` layers; a plan must name exactly that many."""
        formats = self.kv_formats()
        if formats is None:
            return None
        if plan_path(self.kv_cache_dtype) is None:
            return formats * num_layers
        if len(formats) != num_layers:
            raise FieldError("kv_cache_dtype",
                             f"EngineConfig.kv_cache_dtype: the plan names {len(formats)} layers, the model has "
                             f"{num_layers}")
        return formats

    def _format_pair(self, names: tuple[str, str]) -> tuple[KVFormat, KVFormat]:
        kwargs = {"outliers": self.kv_outliers, "sparse_threshold": self.kv_sparse_threshold,
                  "sparse_capacity": self.kv_sparse_capacity, "fp8_scales": self.kv_fp8_scales,
                  "exact_sink": self.kv_exact_sink, "key_wide_channels": self.kv_key_wide_channels,
                  "symmetric_values": self.kv_symmetric_values}
        formats = []
        for name, role in zip(names, ("k", "v")):
            field = f"kv_group_size_{role}"
            own = getattr(self, field)
            try:
                formats.append(make_format(name, role, group_size=self.kv_group_size if own is None else own, **kwargs))
            except FieldError as err:  # name the field the bad group size came from
                if own is None:
                    raise
                raise FieldError(field, str(err).replace("kv_group_size", field, 1)) from None
        return formats[0], formats[1]

    def tokens_per_step(self, max_model_len: int) -> int:
        """max_num_batched_tokens, or its default for an engine whose context is max_model_len."""
        if self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        # The baselines stand for engines without chunking: they prefill prompts whole.
        if self.enable_chunked_prefill and self.cache_mode == "paged":
            return CHUNKED_BATCHED_TOKENS.get(self.torch_device.type, CHUNKED_BATCHED_TOKENS["cpu"])
        return max(max_model_len, 2048)

    @property
    def residual_tokens(self) -> int:
        if self.kv_residual is not None:
            return self.kv_residual
        return max(format_entry(n).default_residual for pair in self.kv_format_names() for n in pair)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def kv_budget_bytes(self) -> int:
        if isinstance(self.kv_cache_memory, str):
            return parse_bytes(self.kv_cache_memory)
        return int(self.kv_cache_memory * available_memory(self.torch_device))


# EngineConfig's fields and the types each accepts (the members of a union).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    name: typing.get_args(hint) or (hint,) for name, hint in typing.get_type_hints(EngineConfig).items()}
_HIDDEN = {f.name for f in fields(EngineConfig) if not f.repr}  # secrets: errors do not repeat them


def _is_a(value: object, kind: type) -> bool:
    """`isinstance`, except that a bool is no number and an int is a float."""
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return is_int(value)
    return isinstance(value, kind)
