"""Offline runs of kvserve with per-request timings: the engine side of every benchmark."""
from __future__ import annotations

import time
from typing import Any

from tqdm import tqdm

from kvserve.bench.metrics import BenchSummary, RequestTiming, summarize
from kvserve.bench.workload import WorkloadRequest
from kvserve.sampling_params import SamplingParams


def greedy_params(requests: list[WorkloadRequest]) -> list[SamplingParams]:
    """ignore_eos makes each request produce exactly its max_tokens, as in the HF baseline; the
    finished outputs are all a benchmark reads (LLM.generate's way)."""
    return [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True, output_kind="final")
            for r in requests]


def run_kvserve(llm: Any, prompts: list[list[int]], params: list[SamplingParams], name: str,
                progress: bool = True) -> BenchSummary:
    """All requests arrive at once; one timing per sample (a request with n > 1 gives n)."""
    engine = llm.engine
    bm = engine.block_manager
    block_bytes = engine.pool.nbytes // bm.num_blocks
    bm.peak_used = 0
    computed_before = engine.tokens_computed
    t0 = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done: dict[tuple[str, int], Any] = {}
    waste_sum, waste_steps, peak_unshared, peak_running, running_time = 0.0, 0, 0, 0, 0.0
    with tqdm(total=sum(sp.n for sp in params), desc=name, unit="seq", disable=not progress) as bar:
        while engine.has_unfinished():
            usage = engine.kv_usage()
            if usage.allocated_slots:
                waste_sum, waste_steps = waste_sum + usage.waste, waste_steps + 1
            peak_unshared = max(peak_unshared, usage.unshared_blocks)
            running = len(engine.scheduler.running)
            peak_running = max(peak_running, running)
            step_start = time.perf_counter()
            outs = engine.step()
            # Sequences at once, weighted by how long they ran: a sequence admitted and then
            # preempted counts for its steps only, unlike in the peak.
            running_time += len(engine.scheduler.running) * (time.perf_counter() - step_start)
            for out in outs:
                if out.finished:
                    done[out.request_id, out.index] = out
                    bar.update(1)
    wall = time.perf_counter() - t0
    timings = [RequestTiming(len(o.prompt_token_ids), len(o.token_ids), t0, o.first_token_time,
                             o.finish_time)
               for rid, sp in zip(ids, params) for o in (done[rid, i] for i in range(sp.n))]
    extra = {"peak_kv_mib": bm.peak_used * block_bytes / 2**20,
             "peak_kv_unshared_mib": peak_unshared * block_bytes / 2**20,
             "kv_waste_pct": 100 * waste_sum / max(waste_steps, 1),
             "prefix_hit_pct": 100 * bm.prefix_stats.hit_rate,
             "tokens_computed": float(engine.tokens_computed - computed_before),
             "preempt_recompute": float(engine.scheduler.preemptions["recompute"]),
             "preempt_swap": float(engine.scheduler.preemptions["swap"]),
             "peak_running": float(peak_running), "mean_running": running_time / wall}
    return summarize(name, timings, wall, extra)
