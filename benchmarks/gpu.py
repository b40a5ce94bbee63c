"""GPU benchmark, self-contained for the `device` tool: `python benchmarks/gpu.py --out DIR`.

Writes a random-weight Llama of the 1B shape (hidden 2048, 16 layers, 32 heads, 8 KV heads) in
HF format on the spot (no download, nothing carried but this repository), then, in one run on
the same workload:
- 128 mixed requests (lognormal prompt and output lengths, token ids drawn at random): kvserve
  (attention_backend auto, i.e. triton) with decode CUDA graphs and without, against HF
  transformers' continuous batching;
- one stream of 128 tokens, warmed: kvserve against HF eager `generate`;
- the share of a decode step the GPU is busy (torch.profiler: kernel time over wall time), with
  the profile's tables in --out.
A part that fails is recorded with its traceback and the others still run.
Each row says how far it is from the machine's limits (weight + KV bytes per decode step over
the measured read bandwidth). Results: gpu.json and the profile tables in --out, and stdout.
"""
from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvserve import LLM
from kvserve.bench.hf_baseline import run_hf_continuous_batching
from kvserve.bench.metrics import summarize
from kvserve.bench.throughput import greedy_params, run_kvserve
from kvserve.bench.workload import WorkloadRequest
from kvserve.measure.request_lengths import lognormal_lengths
from kvserve.measure.roofline import measure_machine

SHAPE_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=49152, max_position_embeddings=4096)
# --tiny: the same script in seconds on a CPU (the test suite runs it so it cannot rot unseen).
SHAPE_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512)


def write_model(directory: Path, shape: dict[str, int]) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**shape, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def workload(n: int, vocab: int, prompt_median: int, output_median: int, seed: int) -> list[WorkloadRequest]:
    rng = np.random.default_rng(seed)
    prompts = lognormal_lengths(rng, prompt_median, 0.8, n, 8, 8 * prompt_median)
    outputs = lognormal_lengths(rng, output_median, 0.8, n, 8, 4 * output_median)
    return [WorkloadRequest(rng.integers(3, vocab, int(p)).tolist(), int(m)) for p, m in zip(prompts, outputs)]


def busy_fraction(llm: LLM, batch: int, steps: int, device: torch.device, profile_out: Path | None = None) -> float:
    """Device kernel time over wall time across `steps` decode steps of `batch` sequences
    (`profile_out`: where the profile's tables go, by device time and by host time)."""
    from torch.profiler import ProfilerActivity, profile
    engine = llm.engine
    params = greedy_params([WorkloadRequest([], steps + 64)])[0]
    ids = [engine.add_request(list(range(10 + i, 74 + i)), params) for i in range(batch)]
    for _ in range(8):  # prefill (chunked) and warm-up
        engine.step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall = time.perf_counter() - t0
    for rid in ids:
        engine.abort(rid)
    if profile_out is not None:
        averages = prof.key_averages()
        profile_out.write_text(f"{steps} decode steps of {batch} sequences, {wall * 1e3:.1f} ms\n\n"
                               + averages.table(sort_by="self_device_time_total", row_limit=30) + "\n\n"
                               + averages.table(sort_by="cpu_time_total", row_limit=40))
    # The engine's record_function labels (kvserve.forward, kvserve.sample) show on the device's
    # timeline too, spanning the kernels they launched: counted with them, busy came out at 1.12.
    kernel_us = sum(e.self_device_time_total for e in prof.events()
                    if e.device_type.name == "CUDA" and not e.is_user_annotation)
    return kernel_us / 1e6 / wall


def free_memory(device: torch.device) -> None:
    """Frees a deleted engine's pool and graphs before the next model takes the memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def hf_one_stream(model: object, prompt: list[int], tokens: int, device: torch.device) -> float:
    ids = torch.tensor([prompt], device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)  # type: ignore[attr-defined]
        sync()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,  # type: ignore[attr-defined]
                       pad_token_id=0)
        sync()
    return tokens / (time.perf_counter() - t0)


def kvserve_rows(model_dir: Path, args: argparse.Namespace, requests: list[WorkloadRequest], one: WorkloadRequest,
                 device: torch.device, cuda_graphs: bool) -> dict:
    tiny = args.tiny
    shape = SHAPE_TINY if tiny else SHAPE_1B
    llm = LLM(model=str(model_dir), dtype="bfloat16", device=str(device), kv_cache_memory="64MiB" if tiny else "40GiB",
              max_model_len=shape["max_position_embeddings"], max_num_seqs=256, cuda_graphs=cuda_graphs, async_scheduling=args.async_scheduling)
    prompts = [r.prompt_token_ids for r in requests]
    run_kvserve(llm, prompts[:8], greedy_params(requests[:8]), "warm-up", progress=False)
    mixed = run_kvserve(llm, prompts, greedy_params(requests), "kvserve mixed")
    run_kvserve(llm, [one.prompt_token_ids], greedy_params([one]), "warm-up", progress=False)
    single = run_kvserve(llm, [one.prompt_token_ids], greedy_params([one]), "kvserve one stream")
    name = "graphs" if cuda_graphs else "eager"
    row = {"attention_backend": llm.engine.attention_backend.name,
           "cuda_graphs": llm.engine.runner.graphs is not None,
           "async_scheduling": llm.engine.async_scheduling,
           "mixed_output_tok_s": mixed.output_tok_s, "mixed_wall_s": mixed.wall_s,
           "one_stream_tok_s": single.output_tok_s,
           "device_busy_fraction": busy_fraction(llm, 4 if tiny else 64, 20, device, args.out / f"profile_{name}.txt"),
           "device_busy_fraction_one_stream": busy_fraction(llm, 1, 20, device),
           "weight_bytes": sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())}
    del llm
    free_memory(device)
    return row


def hf_rows(model_dir: Path, requests: list[WorkloadRequest], one: WorkloadRequest, device: torch.device,
            tiny: bool) -> dict:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    row = {"eager_one_stream_tok_s": hf_one_stream(model, one.prompt_token_ids, len(one.prompt_token_ids), device)}
    timings, wall = run_hf_continuous_batching(model, requests, max_batch=256, num_blocks=64 if tiny else None)
    hf = summarize("hf continuous batching", timings, wall)
    return {**row, "cb_mixed_output_tok_s": hf.output_tok_s, "cb_mixed_wall_s": hf.wall_s}


def section(rows: dict[str, dict], name: str, run: Callable[[], dict]) -> None:
    """One part of the run; a failure is recorded and the other parts still run (one lease of
    the GPU must bring back every number it can)."""
    try:
        rows[name] = run()
    except Exception:  # noqa: BLE001 - recorded in the results, not hidden
        rows[name] = {"error": traceback.format_exc()}
        print(rows[name]["error"], flush=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks the script runs")
    parser.add_argument("--skip-hf", action="store_true", help="kvserve rows only")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="the eager engine only")
    parser.add_argument("--async-scheduling", default="auto", choices=("auto", "on", "off"),
                        help="kvserve's async_scheduling (auto: on for CUDA)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.tiny else "cuda")
    shape = SHAPE_TINY if args.tiny else SHAPE_1B
    machine = measure_machine(torch.bfloat16, device)
    requests = workload(args.requests, shape["vocab_size"], 16 if args.tiny else 256, 8 if args.tiny else 128, 0)
    stream_len = 16 if args.tiny else 128
    one = WorkloadRequest(requests[0].prompt_token_ids[:stream_len], stream_len)
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "llama-random", shape)
        if not args.no_cuda_graphs and device.type == "cuda":  # graphs are CUDA's alone
            section(rows, "kvserve", lambda: kvserve_rows(model_dir, args, requests, one, device, True))
        section(rows, "kvserve_eager", lambda: kvserve_rows(model_dir, args, requests, one, device, False))
        if not args.skip_hf:
            section(rows, "hf", lambda: hf_rows(model_dir, requests, one, device, args.tiny))
    weight_bytes = next((r["weight_bytes"] for r in rows.values() if "weight_bytes" in r), 0)
    rows["machine"] = {"read_gb_s": machine.read_gb_s, "matmul_gflop_s": machine.matmul_gflop_s,
                       "one_stream_weight_read_limit_tok_s": machine.read_gb_s * 1e9 / max(weight_bytes, 1)}
    ours, hf = rows.get("kvserve", rows["kvserve_eager"]), rows.get("hf", {})
    if "cb_mixed_output_tok_s" in hf and "mixed_output_tok_s" in ours:
        rows["ratios"] = {"mixed_vs_hf_cb": ours["mixed_output_tok_s"] / hf["cb_mixed_output_tok_s"],
                          "one_stream_vs_hf_eager": ours["one_stream_tok_s"] / hf["eager_one_stream_tok_s"]}
    (args.out / "gpu.json").write_text(json.dumps(rows, indent=2))
    print(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
