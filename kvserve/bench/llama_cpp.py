"""llama.cpp as a peer (llama-cpp-python): the bundled weights converted to a bf16 GGUF.

The bundled GGUF is Q4_1; kvserve dequantizes it to bf16, so llama.cpp gets the same weights
in bf16 (`llama_model_quantize` with ftype MOSTLY_BF16 and `allow_requantize`), made once and
cached beside kvserve's converted model.
"""
from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvserve.bench.metrics import RequestTiming
from kvserve.bench.workload import WorkloadRequest
from kvserve.paths import cache_root

LLAMA_FTYPE_MOSTLY_BF16 = 32


def bf16_gguf(source: Path) -> Path:
    import llama_cpp

    target = cache_root() / "llama_cpp" / f"{source.stem}.bf16.gguf"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPE_MOSTLY_BF16
    params.allow_requantize = True
    partial = target.with_suffix(".partial")
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize failed ({status}) converting {source} to bf16")
    partial.rename(target)
    return target


def load_llama_cpp(source: Path, n_ctx: int, threads: int) -> Any:
    from llama_cpp import Llama
    return Llama(model_path=str(bf16_gguf(source)), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                 n_batch=512, verbose=False)


def llama_cpp_step_times(llm: Any, prompt_ids: list[int], num_tokens: int, desc: str = "llama.cpp",
                         progress: bool = True) -> list[float]:
    """Seconds each greedy token took for one sequence (the first includes the prefill)."""
    llm.reset()
    times = []
    last = time.perf_counter()
    generator = llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True)
    for _ in tqdm(range(num_tokens), desc=desc, unit="tok", disable=not progress):
        next(generator)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    generator.close()
    return times


def run_llama_cpp_sequential(llm: Any, requests: list[WorkloadRequest],
                             progress: bool = True) -> tuple[list[RequestTiming], float]:
    """Every request arrives at t=0 and llama-cpp-python serves them one after another (its
    Python API runs one sequence at a time), greedy, each to exactly its max_tokens."""
    timings = []
    t0 = time.perf_counter()
    for r in tqdm(requests, desc="llama.cpp", unit="req", disable=not progress):
        steps = llama_cpp_step_times(llm, r.prompt_token_ids, r.max_tokens, progress=False)
        start = time.perf_counter() - sum(steps)
        first = start + steps[0]
        timings.append(RequestTiming(len(r.prompt_token_ids), r.max_tokens, t0, first, start + sum(steps)))
    return timings, time.perf_counter() - t0
