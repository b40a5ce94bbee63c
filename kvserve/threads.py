"""How many CPU threads kvserve runs, and how they wait between parallel regions.

kvserve's CPU kernels run their parallel regions on a pool of their own (kernels/csrc/thread_pool.h)
whose size is torch's intra-op thread count; torch's own ops (prefill matmuls, the sampler) run on
OpenMP. Two process-wide settings decide how both behave on a machine shared with other work:

- the thread count: the cores this process may use (its CPU affinity, and a cgroup's CPU quota,
  which OpenMP's default ignores: a container limited to 2 CPUs on a 64-core host ran 64 threads);
- how long an idle OpenMP thread spins before it sleeps. GNU OpenMP's default (300,000 pauses,
  ~16 ms on a recent Intel core) kept torch's worker spinning through whole decode steps, on the
  core the kernels' own worker needed; `GOMP_SPINCOUNT=1000` (~0.1 ms) lets it sleep.

Both are read once, when the OpenMP runtime loads with torch, so `configure_environment` runs
when kvserve is imported, before kvserve imports torch, and sets only what the user has not set
(`OMP_NUM_THREADS`, `OMP_WAIT_POLICY`, `GOMP_SPINCOUNT`). A program that imported torch first keeps
OpenMP's defaults; `fit_torch_threads` then still lowers torch's thread count to the usable cores
when an engine is built, and `long_spin_warning` says what the spin costs (a CPU engine logs it).
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

GOMP_SPINCOUNT = "1000"


def cgroup_quota(root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs this process's cgroup may use per period (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`),
    or None without a quota."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        try:
            if controllers == "":  # v2
                quota, period = (root / rel / "cpu.max").read_text().split()
                if quota != "max":
                    return int(quota) / int(period)
            elif "cpu" in controllers.split(","):
                base = root / controllers
                quota_us = int((base / rel / "cpu.cfs_quota_us").read_text())
                if quota_us > 0:
                    return quota_us / int((base / rel / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
    return None


def usable_cores() -> int:
    """The cores this process may run on: its affinity, capped by a cgroup CPU quota (rounded up)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def configure_environment() -> None:
    """Thread count and OpenMP spin for this process and its children, where the user set none;
    a no-op once torch is loaded (OpenMP has read its settings then)."""
    if "torch" in sys.modules:
        return
    os.environ.setdefault("OMP_NUM_THREADS", str(usable_cores()))
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)


def long_spin_warning() -> str | None:
    """What OpenMP's default spin costs this process, where it has it: torch was loaded before
    kvserve could set GOMP_SPINCOUNT, and the user set neither it nor OMP_WAIT_POLICY. None
    otherwise. A decode step's few torch ops (the logits' cast, the sampler) then leave torch's
    idle threads spinning on the cores the kernels' threads need."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return None
    return ("kvserve: torch was imported before kvserve, so OpenMP keeps its default spin: its idle "
            "threads spin on the cores kvserve's CPU kernels need, and a decode step of 8 sequences took "
            "1.7x as long (25.0 against 14.6 ms, AMD Zen 4, 2 cores). Import kvserve before torch, or set "
            "OMP_WAIT_POLICY=passive before Python starts.")


def fit_torch_threads() -> int:
    """Lowers torch's intra-op threads (which the kernels' pool follows) to the usable cores, never
    raises them (a caller's `torch.set_num_threads(1)` stays); returns the count in use. More
    threads than cores never helped a step: they only wait for each other's time slices."""
    import torch
    if torch.get_num_threads() > usable_cores():
        torch.set_num_threads(usable_cores())
    return torch.get_num_threads()
