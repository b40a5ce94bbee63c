"""The cache part of the configuration: the KV pool's size and blocks, the prefix cache, and the
tiers below the pool (swap, offload, a remote Redis tier, a disk tier that survives restarts)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from kvserve.config.options import Options, opt, parse_bytes
from kvserve.validate import FieldError

CACHE_MODES = ("paged", "contiguous", "no-cache")
REMOTE_SCHEMES = ("redis://", "rediss://", "unix://")
# Byte sizes given as strings only: a bare number is ambiguous (vLLM's swap_space counts GiB,
# kv_cache_memory takes a fraction of free memory).
_SIZE_FIELDS = ("host_swap_memory", "disk_swap_memory", "offload_memory", "kv_disk_memory")


@dataclass(frozen=True)
class CacheOptions(Options):
    kv_cache_memory: str | float = opt("2GiB", "KV pool size: bytes like 2GiB, or a fraction of free memory like 0.5")
    num_blocks_override: int | None = opt(
        None, "device KV blocks to build, whatever kv_cache_memory holds (vLLM's num_gpu_blocks_override: a "
              "few blocks force preemption, for tests)")
    block_size: int = opt(16, "tokens per KV block")
    cache_mode: str = opt("paged", "paged; contiguous and no-cache are baselines", choices=CACHE_MODES)
    enable_prefix_caching: bool = opt(True, "reuse the K/V of shared prompt prefixes (paged mode)")
    disable_hybrid_kv_cache: bool = opt(
        False, "keep every block of a sliding-window layer (vLLM's disable_hybrid_kv_cache_manager): by default "
               "those layers hold only the blocks their window sees")
    host_swap_memory: str = opt("1GiB", "host tier for swapped blocks", size=True)
    disk_swap_memory: str = opt("0", "file tier, used when the host tier is full; its space is reserved at "
                                     "start-up (refused when swap_dir has too little)", size=True)
    swap_dir: str | None = opt(None, "where the file tier lives (default: the temp dir)")
    offload_memory: str = opt("0", "host memory for the cold blocks of sequences longer than the device pool",
                              size=True)
    kv_remote: str | None = opt(None, "a Redis or Valkey URL (redis://host:port/db) holding full prefix blocks "
                                      "shared by every engine that uses it: blocks are written when they join "
                                      "the prefix cache and read on a local prefix miss")
    kv_remote_timeout: float = opt(0.25, "seconds a kv_remote reply may take; a slower or failed one turns the "
                                         "tier off for 10 s (a warning; the blocks are computed instead)")
    # Never shown: not in the repr, logs, errors or /metrics.
    kv_remote_secret: str | None = field(default=None, repr=False, metadata={"help": (
        "a secret shared by the engines of one kv_remote: each value then carries a keyed BLAKE2b MAC of its key "
        "and pages, so values written without it (by anyone else who can write to the Redis server) are refused, "
        "and engines with another secret share nothing (on the command line it shows in the process list)")})

    kv_disk_dir: str | None = opt(None, "a directory holding full prefix blocks across restarts: blocks are "
                                        "written as they join the prefix cache and read on a prefix miss, by this "
                                        "engine or the next one started on the same directory")
    kv_disk_memory: str = opt("4GiB", "the most bytes kv_disk_dir holds; the least recently used blocks go first",
                              size=True)

    def _check(self) -> None:
        self._one_of("cache_mode", CACHE_MODES)
        self._positive("block_size")
        self._positive("num_blocks_override")
        if isinstance(self.kv_cache_memory, str):
            parse_bytes(self.kv_cache_memory)
        elif not 0 < self.kv_cache_memory <= 1:
            raise FieldError("kv_cache_memory", f"CacheOptions.kv_cache_memory as a fraction must be in (0, 1], "
                                                f"got {self.kv_cache_memory}")
        for name in _SIZE_FIELDS:
            parse_bytes(getattr(self, name), name)
        if self.swap_dir is not None and not (os.path.isdir(self.swap_dir) and os.access(self.swap_dir, os.W_OK)):
            why = "is not a writable directory" if os.path.exists(self.swap_dir) else "does not exist"
            raise FieldError("swap_dir", f"CacheOptions.swap_dir: {self.swap_dir!r} {why}")
        # The baselines have no block tables to offload: refused, not silently ignored.
        if self.cache_mode != "paged" and self.offload_bytes:
            raise FieldError("offload_memory", f"CacheOptions.offload_memory needs cache_mode='paged' "
                                               f"(got {self.cache_mode!r})")
        self._check_remote()

    def _check_remote(self) -> None:
        if self.kv_remote is not None:
            if not self.kv_remote.startswith(REMOTE_SCHEMES):
                raise FieldError("kv_remote", f"CacheOptions.kv_remote: must be a URL starting with "
                                              f"{' or '.join(REMOTE_SCHEMES)}, got {self.kv_remote!r}")
            if self.cache_mode != "paged" or not self.enable_prefix_caching:
                raise FieldError("kv_remote", "CacheOptions.kv_remote: the remote tier extends the prefix cache: "
                                              "it needs cache_mode='paged' and enable_prefix_caching")
        if self.kv_remote_secret is not None and (self.kv_remote is None or not self.kv_remote_secret):
            raise FieldError("kv_remote_secret",
                             "CacheOptions.kv_remote_secret must be a non-empty string, used with kv_remote")
        if self.kv_disk_dir is not None:
            if self.kv_remote is not None:
                raise FieldError("kv_disk_dir", "CacheOptions.kv_disk_dir: one lower tier at a time for now; drop "
                                                "kv_remote or kv_disk_dir")
            if self.cache_mode != "paged" or not self.enable_prefix_caching:
                raise FieldError("kv_disk_dir", "CacheOptions.kv_disk_dir: the disk tier extends the prefix cache: "
                                                "it needs cache_mode='paged' and enable_prefix_caching")
        if not self.kv_remote_timeout > 0:  # NaN too
            raise FieldError("kv_remote_timeout", f"CacheOptions.kv_remote_timeout must be a number of seconds "
                                                  f"> 0, got {self.kv_remote_timeout!r}")

    @property
    def disk_tier_bytes(self) -> int:
        return parse_bytes(self.kv_disk_memory, "kv_disk_memory")

    @property
    def offload_bytes(self) -> int:
        return parse_bytes(self.offload_memory, "offload_memory")

    def swap_bytes(self) -> tuple[int, int]:
        """(host, disk) swap tiers in bytes."""
        return (parse_bytes(self.host_swap_memory, "host_swap_memory"),
                parse_bytes(self.disk_swap_memory, "disk_swap_memory"))

    def budget_bytes(self, device: torch.device) -> int:
        """The pool's bytes: kv_cache_memory, or that fraction of `device`'s free memory."""
        if isinstance(self.kv_cache_memory, str):
            return parse_bytes(self.kv_cache_memory)
        return int(self.kv_cache_memory * _available_memory(device))


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
