"""What the benchmarks' peers (HF transformers, llama.cpp) load, and the dtype HF runs in.

HF's dtype: `--hf-dtype` where given; else kvserve's `--dtype`, except bf16 on a CPU without bf16
instructions (AVX512-BF16 or AMX), where oneDNN emulates bf16 matmuls several times slower than
float32 (BENCHMARKS.md, the Zen 3 rows): there float32 is HF's fastest, the fair peer of kvserve
in bf16, whose own kernels widen bf16 weights on such a CPU.
"""
from __future__ import annotations

from pathlib import Path

import torch

from kvserve.config import DTYPES

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def peer_source(model: str | None) -> str:
    """The file or directory the peers load: random weights have none ("")."""
    from kvserve.model.loader import model_path
    return "" if (model or "").startswith("random:") else str(model_path(model))


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def hf_dtype(hf_dtype_arg: str | None, dtype_arg: str, device: str, flags: set[str] | None = None) -> torch.dtype:
    """The dtype HF transformers runs in (see the module's docstring)."""
    if hf_dtype_arg is not None:
        return DTYPES[hf_dtype_arg]
    dtype = DTYPES[dtype_arg]
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if dtype == torch.bfloat16 and on_cpu and not set(NATIVE_BF16_FLAGS) & (cpu_flags() if flags is None else flags):
        return torch.float32
    return dtype
