"""The doctor's performance section (the article's section 5.3): where a decode step's time goes,
how close it runs to the machine's limits, and how full the batches are.

The split comes from torch.profiler over steps of a running batch, by the labels the engine
puts on its phases (kvserve.schedule / forward / attention / sample, see kvserve.profiling):
the forward pass minus attention is the linears and the small per-layer ops; the step's wall
time minus its labelled phases is Python overhead (bookkeeping, detokenizing, outputs). The
profiler slows small ops down, so its shares are applied to a step timed without it.
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from kvserve.measure.roofline import decode_step_bytes, linear_params, measure_machine
from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams

PHASES = ("kvserve.schedule", "kvserve.forward", "kvserve.attention", "kvserve.sample")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """The process's stderr (file descriptor 2) discarded: the profiler's C++ side (Kineto) prints
    `STAGE:` / `USDT: ... profiler_start` lines there as it starts and stops, and no setting turns
    them off (KINETO_LOG_LEVEL does not)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def decode_profile(llm: LLM, batch: int, prompt: list[int], steps: int) -> dict[str, Any]:
    """`batch` sequences decoding after `prompt`: the split of `steps` steps (ms per step) and
    the bandwidth and compute each step reaches."""
    engine = llm.engine
    device, dtype = engine.device, engine.config.model.torch_dtype
    params = SamplingParams(max_tokens=2 * steps + 16, temperature=0, ignore_eos=True)
    ids = [engine.add_request(prompt[:len(prompt) - i % 4], params) for i in range(batch)]
    try:
        while any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running) \
                or engine.scheduler.waiting:  # prefill (in chunks) and a first decode step
            engine.step()
        engine.step()
        # The step's time without the profiler (which slows small ops down), then its split
        # with it, as shares of the profiled step applied to the unprofiled time.
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync(device)
        wall = time.perf_counter() - start
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        prof = profile(activities=activities)
        with native_stderr_silenced():
            prof.start()
        try:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            _sync(device)
            profiled = time.perf_counter() - start
        finally:
            with native_stderr_silenced():
                prof.stop()
        contexts = [s.num_tokens for s in engine.scheduler.running]
    finally:
        for rid in ids:
            engine.abort(rid)
    step_ms = wall * 1e3 / steps
    share = {e.key: e.cpu_time_total / 1e6 / profiled for e in prof.key_averages() if e.key in PHASES}
    forward, attention = share.get("kvserve.forward", 0.0), share.get("kvserve.attention", 0.0)
    shares = {"linears_and_layer_ops": forward - attention, "attention": attention,
              "sampler": share.get("kvserve.sample", 0.0), "scheduler": share.get("kvserve.schedule", 0.0)}
    shares["python_overhead"] = max(1.0 - sum(shares.values()), 0.0)
    split = {k: v * step_ms for k, v in shares.items()}
    machine = measure_machine(dtype, device)
    cfg = engine.model_config
    weights = decode_step_bytes(cfg, dtype, 0, 0.0)
    step_bytes = weights + sum(contexts) * engine.kv_bytes_per_token
    layers, head = linear_params(cfg)
    flops = 2 * (layers + head) * len(contexts)
    return {"batch": len(contexts), "step_ms": step_ms, "split_ms": split,
            "bytes_per_step": step_bytes, "read_gb_s": machine.read_gb_s,
            "bandwidth_pct": 100 * step_bytes / (wall / steps) / (machine.read_gb_s * 1e9),
            "compute_pct": 100 * flops / (wall / steps) / (machine.matmul_gflop_s * 1e9)}


def batch_efficiency(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, float]:
    """A mixed run: mean running sequences per step over max_num_seqs, and the share of steps in
    which a running sequence got no token (it waited while prompts were prefilled)."""
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
           for p, m in zip(prompts, max_tokens)]
    fill, stalls, steps = 0.0, 0, 0
    try:
        while engine.has_unfinished():
            decoding = {s.seq_id for s in engine.scheduler.running if s.num_computed_tokens >= s.num_tokens - 1}
            got = {o.request_id for o in engine.step()}
            steps += 1
            fill += len(engine.scheduler.running) / engine.config.scheduler.max_num_seqs
            stalls += any(seq_id.split("#")[0] not in got for seq_id in decoding)
    finally:
        for rid in ids:
            engine.abort(rid)
    return {"mean_batch_fill": fill / max(steps, 1), "steps_with_a_stalled_stream": stalls / max(steps, 1),
            "steps": float(steps)}
