"""Offline throughput: kvserve (paged, contiguous) against HF transformers on one workload."""
from __future__ import annotations

import time
from typing import Any

from tqdm import tqdm

from kvserve.bench.metrics import BenchSummary, RequestTiming, summarize
from kvserve.bench.workload import WorkloadRequest
from kvserve.sampling_params import SamplingParams


def run_kvserve(llm: Any, requests: list[WorkloadRequest], name: str,
                progress: bool = True) -> BenchSummary:
    """All requests arrive at once; ignore_eos makes each produce exactly its max_tokens."""
    engine = llm.engine
    block_bytes = engine.pool.nbytes // engine.block_manager.num_blocks
    engine.block_manager.peak_used = 0
    t0 = time.perf_counter()
    ids = [engine.add_request(r.prompt_token_ids,
                              SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True))
           for r in requests]
    done: dict[str, Any] = {}
    waste_sum, waste_steps = 0.0, 0
    with tqdm(total=len(ids), desc=name, unit="req", disable=not progress) as bar:
        while engine.has_unfinished():
            usage = engine.kv_usage()
            if usage.allocated_slots:
                waste_sum, waste_steps = waste_sum + usage.waste, waste_steps + 1
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
    wall = time.perf_counter() - t0
    timings = [RequestTiming(len(o.prompt_token_ids), len(o.token_ids), t0, o.first_token_time,
                             o.finish_time) for o in (done[i] for i in ids)]
    extra = {"peak_kv_mib": engine.block_manager.peak_used * block_bytes / 2**20,
             "kv_waste_pct": 100 * waste_sum / max(waste_steps, 1),
             "preemptions": float(engine.scheduler.num_preemptions)}
    return summarize(name, timings, wall, extra)
