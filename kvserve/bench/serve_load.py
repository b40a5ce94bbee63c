"""`kvserve bench serve`: `kvserve serve` in another process (or the server at `--url`) and the
`--peers` (bench/serve_peers.py), each sent a workload's sessions (bench/serving_workloads.py) by
the client of bench/serving.py, `--rounds` times taking turns (bench/serve_rounds.py); and the
same requests through offline `LLM.generate` for the server's overhead. One server runs at a time,
never two side by side: on a small machine they would share the cores. Every server starts fresh
each round, so each round's first rate meets a cold prefix cache."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from kvserve.bench.serve_peers import START_TIMEOUT_S, Peer, Skipped, resolve_peers
from kvserve.bench.serve_steps import read_step_totals, steps_line
from kvserve.bench.serve_rounds import comparison_table, each_round, median_summary, round_order
from kvserve.bench.server_process import ChildServer
from kvserve.bench.serving import ServingSummary, format_summary, run_load, summarize, token_id_prompt
from kvserve.bench.serving_sweep import plot_sweep, sweep_table
from kvserve.bench.serving_workloads import Session, Shape, make_sessions
from kvserve.bench.workload import load_text_ids
from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams

OURS = "kvserve serve"


class ServerProcess(ChildServer):
    """`kvserve serve` on a free loopback port; ready once /health answers."""

    def __init__(self, *args: str, start_timeout: float = 180) -> None:
        super().__init__(lambda port: [sys.executable, "-m", "kvserve", "serve", "--port", str(port), "--log-level",
                                       "warning", *args], OURS, start_timeout)

    def kv_state(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/kv/state", timeout=30).json()


def _engine_args(args: argparse.Namespace, num_requests: int) -> list[str]:
    return ["--dtype", args.dtype, "--device", args.device, "--kv-cache-memory", str(args.kv_cache_memory),
            "--block-size", str(args.block_size), "--max-num-seqs", str(args.max_num_seqs),
            "--max-model-len", str(args.max_model_len), "--max-waiting", str(num_requests + 1),
            *(["--model", args.model] if args.model else []),
            *([] if args.enable_prefix_caching else ["--no-enable-prefix-caching"])]


def _offline_tok_s(llm: LLM, requests: list[Any]) -> float:
    prompts = [r.prompt_token_ids for r in requests]
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in requests]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up, as the server's first requests
    t0 = time.perf_counter()
    return sum(len(o.token_ids) for o in llm.generate(prompts, params)) / (time.perf_counter() - t0)


def run_serve_bench(args: argparse.Namespace, llm: LLM, out: Path) -> None:
    text_name, ids = load_text_ids(llm.tokenizer, args.data)
    shape = Shape()
    # Each rate's own draw of the text: no run reuses the prefixes of the rate before on the same
    # server; every server and round gets the same draws.
    draws = [make_sessions(args.workload, ids, args.seed + 1000 * i, shape, args.num_requests,
                           args.prompt_len_median, args.output_len_median) for i in range(len(args.request_rate))]
    requests = [r for session in draws[0] for r in session]
    # The server may be another machine's: no offline peer then.
    offline_tok_s = None if args.url else _offline_tok_s(llm, requests)
    del llm

    first = args.url or OURS
    peers: dict[str, Peer] = {}
    skipped: dict[str, str] = {}
    for peer in resolve_peers(args):
        if isinstance(peer, Skipped):
            skipped[peer.name] = peer.reason
            print(f"peer {peer.name} skipped: {peer.reason}", flush=True)
        else:
            peers[peer.name] = peer
    warm_up = make_sessions("random", ids, args.seed + 1, shape, 4, 32, 8)  # other slices: a cold cache after
    runs: dict[str, list[list[ServingSummary]]] = {}  # server -> rate -> one summary per round
    errors: dict[str, list[str]] = {}
    blocks: list[str] = []
    state = None
    for r, name in round_order([first, *peers], args.rounds):
        if name in skipped:  # it failed to start in an earlier round
            continue
        print(f"round {r + 1} of {args.rounds}: {name}", flush=True)
        try:
            server = _start(name, args, peers, len(requests))
        except RuntimeError as err:
            if name == first:
                raise
            skipped[name] = f"it did not start: {err}"
            print(f"peer {name} skipped: {skipped[name]}", flush=True)
            continue
        peer = peers.get(name)
        fields = token_id_prompt if peer is None else peer.prompt_fields
        model = args.served_model_name if name == args.url else None
        try:
            run_load(args.url if server is None else server.url, warm_up, model=model, prompt_fields=fields)
            # kvserve's own step timers, read around each run: where the server's wall time went.
            steps_url = server.url if isinstance(server, ServerProcess) else None
            for i, (rate, sessions) in enumerate(zip(args.request_rate, draws)):
                before = read_step_totals(steps_url) if steps_url else None
                records, wall = run_load(args.url if server is None else server.url, sessions, rate,
                                         args.burstiness, args.max_concurrency, args.seed, model, fields)
                summary = summarize(records, wall, args.goodput)
                runs.setdefault(name, [[] for _ in args.request_rate])[i].append(summary)
                errors.setdefault(name, []).extend(rec.error for rec in records if rec.error)
                label = f"{name} at {rate} req/s" + (f", round {r + 1}" if args.rounds > 1 else "")
                blocks += [*format_summary(label, summary), ""]
                if steps_url and before:
                    blocks += [steps_line(before, read_step_totals(steps_url), wall), ""]
                print(f"  {rate} req/s: output {summary.output_tok_s:.1f} tok/s, {summary.failed} failed", flush=True)
            if isinstance(server, ServerProcess):
                state = server.kv_state()
        finally:
            if server is not None:
                server.stop()
    runs = {name: rates for name, rates in runs.items() if name not in skipped}
    report = _report(args, text_name, shape, draws, peers, runs, skipped, blocks, out)
    if offline_tok_s is not None and state is not None:
        report += [f"offline LLM.generate, all at once: {offline_tok_s:.1f} output tok/s; server / offline (first "
                       f"rate, median): {median_summary(runs[first][0]).output_tok_s / offline_tok_s:.3f}x. KV blocks "
                       f"in use afterwards: {sum(c in 'US' for c in state['states'])}; running/waiting afterwards: "
                       f"{state['running']}/{state['waiting']}"]
    report += [f"first errors of {name}: {errs[:3]}" for name, errs in errors.items() if errs]
    text = "\n".join(report)
    print(text)
    (out / "serve_load.md").write_text(text + "\n")
    (out / "serve_rounds.json").write_text(json.dumps(
        {"runs": {name: {str(rate): [dataclasses.asdict(s) for s in rounds] for rate, rounds in
                         zip(args.request_rate, rates)} for name, rates in runs.items()},
         "skipped": skipped}, indent=2))


def _start(name: str, args: argparse.Namespace, peers: dict[str, Peer], num_requests: int) -> ChildServer | None:
    """The server `name` started, or None for the one at --url (already running)."""
    if name == args.url:
        return None
    if name == OURS:
        return ServerProcess(*_engine_args(args, num_requests))
    peer = peers[name]
    return ChildServer(peer.command, name, START_TIMEOUT_S, peer.env)


def _report(args: argparse.Namespace, text_name: str, shape: Shape, draws: list[list[Session]],
            peers: dict[str, Peer], runs: dict[str, list[list[ServingSummary]]], skipped: dict[str, str],
            blocks: list[str], out: Path) -> list[str]:
    """The report's lines: what ran, every run's rows, then the servers compared and the sweep."""
    sessions = draws[0]
    requests = [r for session in sessions for r in session]
    what = (f"lognormal prompts (median {args.prompt_len_median}) and outputs (median {args.output_len_median})"
            if args.workload == "random" else f"shape {dataclasses.asdict(shape)}")
    ours = (f"the server at {args.url}" if args.url else
            f"kvserve serve: dtype {args.dtype}, max_num_seqs {args.max_num_seqs}, prefix caching "
            f"{args.enable_prefix_caching}, torch threads {torch.get_num_threads()}")
    lines = [f"workload {args.workload}: {len(sessions)} sessions, {len(requests)} streaming completions of "
             f"{text_name} slices, {what}, ignore_eos; request rate {', '.join(map(str, args.request_rate))} "
             f"(burstiness {args.burstiness}), max concurrency {args.max_concurrency}, seed {args.seed}; "
             f"{args.rounds} round(s), servers taking turns; {ours}",
             *(f"- {name}: {peer.describe(requests)}" for name, peer in peers.items()), "", *blocks]
    compare = len(runs) > 1 or skipped or args.rounds > 1
    for i, rate in enumerate(args.request_rate):
        if not compare:
            break
        at = {name: rates[i] for name, rates in runs.items()}
        lines += [f"### At {rate} req/s: median of {args.rounds} round(s); ratios: medians of each round's", "",
                  *comparison_table(at, skipped if i == 0 else {}), ""]
        if args.rounds > 1:
            lines += [*each_round(at), ""]
    if len(args.request_rate) > 1:
        curves = {name: [(rate, median_summary(rounds)) for rate, rounds in zip(args.request_rate, rates)]
                  for name, rates in runs.items()}
        for name, rows in curves.items():
            lines += [f"### {name}: the sweep", "", *sweep_table(rows), ""]
        plot_sweep(curves, out / "serve_sweep.png")
    return lines
