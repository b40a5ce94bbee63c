"""`kvserve serve` in another process, for tests and `kvserve bench serve`: a workload's sessions
(bench/serving_workloads.py) sent by the client of bench/serving.py, and the same requests through
offline `LLM.generate` for the server's overhead. The server and the offline engine run one after
the other, never side by side: on a small machine they would share the cores."""
from __future__ import annotations

import argparse
import dataclasses
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from kvserve.bench.serving import ServingSummary, format_summary, run_load, summarize
from kvserve.bench.serving_sweep import plot_sweep, sweep_table
from kvserve.bench.serving_workloads import Shape, make_sessions
from kvserve.bench.workload import load_text_ids
from kvserve.engine.llm import LLM
from kvserve.net import free_loopback_port
from kvserve.sampling_params import SamplingParams


class ServerProcess:
    """`kvserve serve` on a free loopback port; ready once /health answers."""

    def __init__(self, *args: str, start_timeout: float = 180) -> None:
        self.port = free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve", "serve", "--port", str(self.port), "--log-level", "warning", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")  # type: ignore[union-attr]
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not come up in {start_timeout:.0f} s")

    def kv_state(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/kv/state", timeout=30).json()

    def stop(self) -> None:
        """SIGTERM: the server finishes what runs, then exits."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def run_serve_bench(args: argparse.Namespace, llm: LLM, out: Path) -> None:
    text_name, ids = load_text_ids(llm.tokenizer, args.data)
    shape = Shape()
    sessions = make_sessions(args.workload, ids, args.seed, shape, args.num_requests, args.prompt_len_median,
                             args.output_len_median)
    requests = [r for session in sessions for r in session]
    prompts = [r.prompt_token_ids for r in requests]
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in requests]
    offline_tok_s = None
    if args.url is None:  # the server may be another machine's: no offline peer then
        llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up, as the server's first requests
        t0 = time.perf_counter()
        offline_tok_s = sum(len(o.token_ids) for o in llm.generate(prompts, params)) / (time.perf_counter() - t0)
    del llm

    engine_args = ["--dtype", args.dtype, "--device", args.device, "--kv-cache-memory", str(args.kv_cache_memory),
                   "--block-size", str(args.block_size), "--max-num-seqs", str(args.max_num_seqs),
                   "--max-model-len", str(args.max_model_len), "--max-waiting", str(len(requests) + 1),
                   *(["--model", args.model] if args.model else []),
                   *([] if args.enable_prefix_caching else ["--no-enable-prefix-caching"])]
    server = None if args.url else ServerProcess(*engine_args)
    url = args.url if server is None else server.url
    rows: list[tuple[float, ServingSummary]] = []
    errors: list[str] = []
    try:
        # Warm-up on other slices of the text, excluded: a cold prefix cache for the measured run.
        run_load(url, make_sessions("random", ids, args.seed + 1, shape, 4, 32, 8), model=args.served_model_name)
        for i, rate in enumerate(args.request_rate):
            # Each rate's own draw of the text: no run reuses the prefixes of the one before.
            run_sessions = sessions if i == 0 else make_sessions(
                args.workload, ids, args.seed + 1000 * i, shape, args.num_requests, args.prompt_len_median,
                args.output_len_median)
            records, wall = run_load(url, run_sessions, rate, args.burstiness, args.max_concurrency, args.seed,
                                     args.served_model_name)
            rows.append((rate, summarize(records, wall, args.goodput)))
            errors += [r.error for r in records if r.error]
        state = None if server is None else server.kv_state()
    finally:
        if server is not None:
            server.stop()
    what = (f"lognormal prompts (median {args.prompt_len_median}) and outputs (median {args.output_len_median})"
            if args.workload == "random" else f"shape {dataclasses.asdict(shape)}")
    served = (f"the server at {args.url}" if server is None else
              f"kvserve serve: dtype {args.dtype}, max_num_seqs {args.max_num_seqs}, prefix caching "
              f"{args.enable_prefix_caching}, torch threads {torch.get_num_threads()}")
    name = args.url or "kvserve serve"
    lines = [f"workload {args.workload}: {len(sessions)} sessions, {len(requests)} streaming completions of "
             f"{text_name} slices, {what}, ignore_eos; request rate {', '.join(map(str, args.request_rate))} "
             f"(burstiness {args.burstiness}), max concurrency {args.max_concurrency}, seed {args.seed}; {served}", ""]
    for rate, summary in rows:
        lines += [*format_summary(f"{name} at {rate} req/s", summary), ""]
    if len(rows) > 1:
        lines += sweep_table(rows)
        plot_sweep(name, rows, out / "serve_sweep.png")
    if offline_tok_s is not None and state is not None:
        lines += ["", f"offline LLM.generate, all at once: {offline_tok_s:.1f} output tok/s; server / offline (first "
                      f"rate): {rows[0][1].output_tok_s / offline_tok_s:.3f}x. KV blocks in use afterwards: "
                      f"{sum(c in 'US' for c in state['states'])}; running/waiting afterwards: "
                      f"{state['running']}/{state['waiting']}"]
    if errors:
        lines.append(f"first errors: {errors[:3]}")
    text = "\n".join(lines)
    print(text)
    (out / "serve_load.md").write_text(text + "\n")
