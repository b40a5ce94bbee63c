"""Gemma 3 270M, throughput on a long-context mixed workload (issue 41): `python benchmarks/gemma3_throughput.py`.

Every request arrives at t=0; greedy, EOS ignored, so each produces exactly its output length.
Prompts are slices of a text (`--data`, as `kvserve bench throughput`), their lengths drawn
uniformly in [--prompt-min, --prompt-max] (default 2,048-5,120 tokens: past the sliding layers'
512-token window), outputs in [--output-min, --output-max] (default 64-128).

Peers, each on the same weights (the Q4_K_M GGUF dequantized to bf16):
- kvserve, bf16, hybrid KV cache on (`--hybrid-off` adds a row with every layer full), all the
  requests admitted at once (`max_num_seqs` = the number of requests, a KV budget that holds them),
  prefix caching off (a later round would otherwise find the same prompts cached);
- HF transformers' continuous batching (`init_continuous_batching`, paged cache, the same
  `max_requests_per_batch`) in a process of its own with OpenMP's default spin
  (bench/hf_process.py), on kvserve's conversion of the GGUF, `--hf-dtype` (default bf16);
- llama.cpp (llama-cpp-python) on the bf16 GGUF (bench/llama_cpp.py `bf16_gguf`): its Python API
  serves one sequence at a time, so the requests run one after another
  (`run_llama_cpp_sequential`); its SWA cache window-sized (`swa_full=False`).
Peers take turns in `--rounds` rounds (the order reversed every other round, so a drifting load
hits each alike); the tables give medians and the median of each round's kvserve / peer ratio.

Roofline, measured on the spot after the rounds: read bandwidth (an fp32 sum over 1 GiB) and a
bf16 GEMM's rate (1024x2048 by 2048x4096), as `kvserve bench throughput`. Useful FLOPs count every
token through the layers' matmuls, the LM head once per generated token, and attention over the
positions each layer sees (the window in the sliding layers; `workload_flops` in
kvserve/measure/roofline.py counts every layer full, also shown).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import kvserve  # noqa: F401  before torch: kvserve sets OpenMP's spin (threads.py)
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemma3_hybrid import MODEL, llama_cpp_model, machine, source_state  # noqa: E402

from kvserve import LLM  # noqa: E402
from kvserve.bench.metrics import BenchSummary, summarize  # noqa: E402
from kvserve.bench.throughput import greedy_params, run_kvserve  # noqa: E402
from kvserve.bench.workload import WorkloadRequest, load_text_ids  # noqa: E402
from kvserve.measure.roofline import linear_params, measure_machine, workload_flops  # noqa: E402
from kvserve.model.config import ModelConfig  # noqa: E402
from kvserve.model.named_models import named_model_path  # noqa: E402


def long_workload(ids: list[int], args: argparse.Namespace) -> list[WorkloadRequest]:
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(args.prompt_min, args.prompt_max + 1, args.num_requests)
    outputs = rng.integers(args.output_min, args.output_max + 1, args.num_requests)
    offsets = rng.integers(0, len(ids) - args.prompt_max, args.num_requests)
    return [WorkloadRequest(list(ids[o:o + p]), int(m)) for o, p, m in zip(offsets, prompts, outputs)]


def windowed_flops(cfg: ModelConfig, requests: list[WorkloadRequest]) -> float:
    """`workload_flops` with each layer's attention over the positions it sees (min(i, window))."""
    layers, head = linear_params(cfg)
    per_pair = 4 * cfg.num_heads * cfg.head_dim
    total = 0.0
    for r in requests:
        n = len(r.prompt_token_ids) + r.max_tokens
        pairs = sum(n * (n + 1) / 2 if w is None else
                    min(n, w) * (min(n, w) + 1) / 2 + max(0, n - w) * w for w in cfg.layer_windows)
        total += 2 * layers * n + 2 * head * r.max_tokens + per_pair * pairs
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--prompt-min", type=int, default=2048)
    p.add_argument("--prompt-max", type=int, default=5120)
    p.add_argument("--output-min", type=int, default=64)
    p.add_argument("--output-max", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="text the prompts are sliced from (as `kvserve bench --data`)")
    p.add_argument("--kv-cache-memory", default="512MiB", help="kvserve's KV budget (default 512MiB)")
    p.add_argument("--hf-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--hybrid-off", action="store_true", help="add kvserve with every layer full")
    p.add_argument("--peers", default="kvserve,hf,llama.cpp", help="which peers run (default all three)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="markdown file for the results")
    args = p.parse_args()
    peers = args.peers.split(",")
    source = named_model_path(MODEL)
    threads = torch.get_num_threads()
    max_len = args.prompt_max + args.output_max + 16
    llms = {}
    for hybrid in (True, False) if args.hybrid_off else (True,):
        llms[f"kvserve bf16, hybrid {'on' if hybrid else 'off'}"] = LLM(
            model=MODEL, dtype="bfloat16", device="cpu", kv_cache_memory=args.kv_cache_memory, max_model_len=max_len,
            max_num_seqs=args.num_requests, disable_hybrid_kv_cache=not hybrid, enable_prefix_caching=False)
    first = next(iter(llms.values()))
    text_name, ids = load_text_ids(first.tokenizer, args.data)
    requests = long_workload(ids, args)
    prompts, params = [r.prompt_token_ids for r in requests], greedy_params(requests)
    prompt_tokens, output_tokens = sum(map(len, prompts)), sum(r.max_tokens for r in requests)
    lines = [f"# Gemma 3 270M, long-context mixed workload: `python {' '.join(sys.argv)}`", "",
             f"Machine: {machine()}", f"Tree: {source_state()}",
             f"Model: {source.name} (dequantized to bf16 for kvserve and HF; requantized to a bf16 GGUF for llama.cpp)",
             f"Workload: {len(requests)} requests from {text_name}, seed {args.seed}, all at t=0; prompts "
             f"{', '.join(str(len(x)) for x in prompts)} tokens ({prompt_tokens:,} in all), outputs "
             f"{', '.join(str(r.max_tokens) for r in requests)} ({output_tokens:,} in all); greedy, EOS ignored",
             f"kvserve: KV budget {args.kv_cache_memory}, max_num_seqs {args.num_requests}, prefix caching off, attention backend "
             f"{first.engine.attention_backend.name}, {threads} torch threads", ""]
    print("\n".join(lines), flush=True)

    # Warm-ups on token ids no request starts with: no peer's timed run may hit a cached prefix.
    warm = [int(t) for t in np.random.default_rng(args.seed + 1).integers(1000, 100000, 600)]
    runners = {}
    for name, llm in llms.items():
        if "kvserve" in peers:
            run_kvserve(llm, [warm], greedy_params([WorkloadRequest(warm, 4)]), "warm-up", progress=False)
            runners[name] = lambda llm=llm, name=name: run_kvserve(llm, prompts, params, name, progress=False)
    hf = lc = None
    if "hf" in peers:
        from kvserve.bench.hf_process import HFProcess

        hf = HFProcess(str(source), getattr(torch, args.hf_dtype), threads)
        name = f"HF transformers continuous batching, {args.hf_dtype} (own process)"
        runners[name] = lambda name=name: summarize(name, *hf.batches("continuous", requests, args.num_requests))
        lines.append(f"HF: transformers continuous batching, max_requests_per_batch {args.num_requests}, "
                     f"{args.hf_dtype}; each run's warm-up batch (2 tokens) outside its clock")
    if "llama.cpp" in peers:
        if importlib.util.find_spec("llama_cpp") is None:
            lines.append("llama.cpp: not installed (no `llama_cpp` module): no llama.cpp row")
        else:
            from importlib.metadata import version

            from kvserve.bench.llama_cpp import bf16_gguf, llama_cpp_step_times, run_llama_cpp_sequential

            lc = llama_cpp_model(bf16_gguf(source), max_len, threads)
            llama_cpp_step_times(lc, warm, 4, progress=False)
            name = "llama.cpp bf16 GGUF, one request at a time"
            runners[name] = lambda name=name: summarize(name, *run_llama_cpp_sequential(lc, requests, progress=False))
            lines.append(f"llama.cpp: llama-cpp-python {version('llama_cpp_python')}, n_ctx {max_len}, n_batch 512, "
                         f"n_threads {threads}, swa_full False (its window-sized SWA cache)")
    lines.append("")
    rounds: list[dict[str, BenchSummary]] = []
    loads: list[dict[str, float]] = []
    for r in range(args.rounds):
        order = list(runners) if r % 2 == 0 else list(reversed(runners))
        rounds.append({}), loads.append({})
        for name in order:
            loads[-1][name] = os.getloadavg()[0]
            start = time.perf_counter()
            rounds[-1][name] = runners[name]()
            s = rounds[-1][name]
            print(f"round {r + 1}: {name}: {s.output_tok_s:.2f} output tok/s, wall {s.wall_s:.1f} s "
                  f"(run {time.perf_counter() - start:.0f} s), load average before {loads[-1][name]:.2f}", flush=True)
    if hf is not None:
        hf.close()
    hw = measure_machine(torch.bfloat16)
    cfg = first.engine.model_config
    flops, full_flops = windowed_flops(cfg, requests), workload_flops(cfg, [(len(x), r.max_tokens)
                                                                          for x, r in zip(prompts, requests)])
    ours = next(iter(llms))
    lines += [f"Roofline, measured after the rounds: read {hw.read_gb_s:.1f} GB/s, bf16 matmul "
              f"{hw.matmul_gflop_s:.0f} GFLOP/s; the workload is {flops / 1e12:.2f} TFLOP useful with the sliding "
              f"layers' window ({full_flops / 1e12:.2f} counting every layer full): compute roofline "
              f"{flops / hw.matmul_gflop_s / 1e9:.1f} s. Decode alone reads >= {sum(linear_params(cfg)) * 2 / 1e6:.0f} "
              f"MB of bf16 weights a step: one sequence at a time at most "
              f"{hw.read_gb_s * 1e9 / (sum(linear_params(cfg)) * 2):.0f} tok/s", "",
              f"| series | output tok/s (median) | total tok/s | wall s | TTFT p50 s | TPOT p50 ms | each round, output "
              f"tok/s (load average before) | {ours} / this, output tok/s (median of rounds' ratios) | "
              f"% of compute roofline |", "|---|---|---|---|---|---|---|---|---|"]
    for name in runners:
        med = lambda key: statistics.median(getattr(r[name], key) for r in rounds)  # noqa: E731
        ratio = statistics.median(r[ours].output_tok_s / r[name].output_tok_s for r in rounds)
        wall = med("wall_s")
        lines.append(f"| {name} | {med('output_tok_s'):.2f} | {med('total_tok_s'):.0f} | {wall:.1f} | "
                     f"{med('ttft_p50_ms') / 1e3:.1f} | {med('tpot_p50_ms'):.0f} | "
                     f"{', '.join(f'{r[name].output_tok_s:.2f} ({lo[name]:.1f})' for r, lo in zip(rounds, loads))} | "
                     f"{ratio:.2f}x | {100 * flops / wall / (hw.matmul_gflop_s * 1e9):.0f}% |")
    extra = [f"- {name}: peak running {statistics.median(r[name].extra['peak_running'] for r in rounds):.0f}, mean "
             f"running {statistics.median(r[name].extra['mean_running'] for r in rounds):.2f}, peak KV "
             f"{statistics.median(r[name].extra['peak_kv_mib'] for r in rounds):.1f} MiB, prefix hits "
             f"{max(r[name].extra['prefix_hit_pct'] for r in rounds):.0f}%, preemptions "
             f"{max(r[name].extra['preempt_recompute'] + r[name].extra['preempt_swap'] for r in rounds):.0f}"
             for name in llms if name in runners]
    lines += [""] + extra + [""]
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
