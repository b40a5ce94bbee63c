"""`kvserve bench throughput | scaling | memory | serve | kv-formats | evictions | attention | soak`."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from kvserve.arg_types import at_least, folder
from kvserve.bench.format_lists import attention_formats, kv_formats_defaults
from kvserve.bench.metrics import format_table, ratio, same_budget_table
from kvserve.bench.peer_weights import hf_dtype, peer_source
from kvserve.bench.serve_peers import add_peer_args
from kvserve.bench.serving import add_load_args
from kvserve.bench.serving_workloads import WORKLOADS
from kvserve.bench.speculative import add_spec_parser, run_spec_bench
from kvserve.config import DTYPES
from kvserve.engine_args import add_engine_args, kv_format_overrides, llm_from_args
from kvserve.texts import DATA_HELP


def _workload_args(p: argparse.ArgumentParser, num_requests: int, prompt_median: int, output_median: int,
                   requests_help: str = "requests in the workload") -> None:
    """The options of a benchmark whose requests are slices of a text (see `_workload`)."""
    p.add_argument("--num-requests", type=at_least(1), default=num_requests,
                   help=f"{requests_help} (default {num_requests})")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--prompt-len-median", type=at_least(1), default=prompt_median,
                   help=f"median prompt length in tokens; prompts are slices of --data, their lengths "
                        f"lognormal about this median (default {prompt_median})")
    p.add_argument("--output-len-median", type=at_least(1), default=output_median,
                   help=f"median tokens generated per request (greedy, EOS ignored), lognormal about this "
                        f"median (default {output_median})")
    p.add_argument("--data", default=None, help=DATA_HELP)
    p.add_argument("--out", type=folder, default="bench_out", help="folder for the JSON and markdown results")


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks against HF transformers, run side by side")
    kinds = bench.add_subparsers(dest="bench", required=True)

    tp = kinds.add_parser("throughput", help="offline throughput on a text-sliced workload vs HF and llama.cpp")
    _workload_args(tp, num_requests=64, prompt_median=128, output_median=64)
    tp.add_argument("--sigma", type=float, default=0.8, help="lognormal spread of lengths (default 0.8)")
    tp.add_argument("--max-prompt-len", type=at_least(1), default=1024,
                    help="longest prompt in tokens: longer draws are cut to it (default 1024)")
    tp.add_argument("--max-output-len", type=at_least(1), default=512,
                    help="most tokens a request generates: longer draws are cut to it (default 512)")
    tp.add_argument("--skip-hf", action="store_true", help="leave out HF transformers (static and continuous)")
    _hf_dtype_arg(tp)
    tp.add_argument("--skip-llama-cpp", action="store_true",
                    help="leave out llama.cpp (llama-cpp-python, one request at a time: its Python API serves one)")
    tp.add_argument("--skip-contiguous", action="store_true", help="skip the contiguous baseline")
    add_engine_args(tp)
    tp.set_defaults(func=run, max_model_len=2048)

    mem = kinds.add_parser("memory", help="prefix caching, n-sample sharing, swap vs recompute")
    mem.add_argument("--data", default=None, help=DATA_HELP)
    mem.add_argument("--out", type=folder, default="bench_out", help="folder for memory.md (default bench_out)")
    add_engine_args(mem)
    mem.set_defaults(func=run, max_model_len=2048, max_num_seqs=8)

    sv = kinds.add_parser("serve", help="streaming load on `kvserve serve` (TTFT, TPOT, ITL, goodput) vs offline "
                                        "generate, llama-server and transformers serve")
    _workload_args(sv, num_requests=200, prompt_median=128, output_median=64)
    add_load_args(sv)
    add_peer_args(sv)
    _hf_dtype_arg(sv)
    _rounds_arg(sv)
    sv.add_argument("--workload", choices=WORKLOADS, default="random",
                    help="random (lognormal lengths, --num-requests and the medians), shared-prefix, multi-turn or "
                         "long-context (their shapes: bench/serving_workloads.py; the report prints them)")
    add_engine_args(sv)
    sv.set_defaults(func=run, max_model_len=2048)

    sk = kinds.add_parser("soak", help="server memory (RSS) over a long mixed run with clients hanging up")
    sk.add_argument("--duration", type=float, default=720, help="seconds of load (default 720)")
    sk.add_argument("--concurrency", type=at_least(1), default=16, help="clients at once (default 16)")
    sk.add_argument("--hangup", type=float, default=0.3, help="share of requests abandoned mid-way (default 0.3)")
    sk.add_argument("--sample", type=float, default=30, help="seconds between RSS samples (default 30)")
    _workload_args(sk, num_requests=400, prompt_median=128, output_median=32,
                   requests_help="distinct requests drawn from")
    add_engine_args(sk)
    sk.set_defaults(func=run, max_model_len=2048)

    kf = kinds.add_parser("kv-formats", help="concurrency and throughput per KV format at one KV budget")
    formats = ",".join(kv_formats_defaults())
    kf.add_argument("--formats", default=formats,
                    help=f"kv_cache_dtype values, each optionally name@residual (default {formats})")
    _workload_args(kf, num_requests=32, prompt_median=256, output_median=32)
    _rounds_arg(kf)
    add_engine_args(kf)
    kf.set_defaults(func=run, max_model_len=2048, kv_cache_memory="128MiB", max_num_seqs=48)

    ev = kinds.add_parser("evictions", help="concurrency and throughput per kv_eviction policy at one KV budget")
    ev.add_argument("--policies", default="none,window,snapkv,tova,h2o,strided",
                    help="kv_eviction values, the first the baseline (default none,window,snapkv,tova,h2o,strided)")
    _workload_args(ev, num_requests=24, prompt_median=1024, output_median=128)
    _rounds_arg(ev)
    add_engine_args(ev)
    ev.set_defaults(func=run, max_model_len=4096, kv_cache_memory="96MiB", max_num_seqs=48, kv_budget=512)

    at = kinds.add_parser("attention", help="attention backends on one layer: same pages, same queries")
    formats = ",".join(attention_formats())
    at.add_argument("--formats", default=formats, help=f"kv_cache_dtype values (default {formats})")
    at.add_argument("--out", type=folder, default="bench_out", help="folder for attention.md (default bench_out)")
    at.set_defaults(func=run)

    rp = kinds.add_parser("replicas", help="replicas on Ray Serve: prefix-aware vs Ray's default vs round-robin "
                                           "routing, with and without the Redis KV tier")
    rp.add_argument("--replicas", type=at_least(1), default=2, help="replicas (default 2)")
    rp.add_argument("--num-system-prompts", type=at_least(1), default=8,
                    help="system prompts the requests share (default 8)")
    rp.add_argument("--num-requests", type=at_least(1), default=64, help="requests (default 64)")
    rp.add_argument("--system-len", type=at_least(1), default=256, help="tokens per system prompt (default 256)")
    rp.add_argument("--user-len", type=at_least(1), default=32, help="tokens of each request's own turn (default 32)")
    rp.add_argument("--max-tokens", type=at_least(1), default=16, help="tokens generated per request (default 16)")
    rp.add_argument("--concurrency", type=at_least(1), default=8, help="requests in flight at once (default 8)")
    rp.add_argument("--routers", default="prefix,power-of-two,round-robin",
                    help="comma-separated routers to compare (default: all three)")
    rp.add_argument("--remote", default="none,redis",
                    help="comma-separated: none, and redis (a local redis-server this run starts and empties "
                         "before each configuration); default both")
    rp.add_argument("--router-stats-period", type=float, default=1.0,
                    help="seconds between each replica's report of its cached blocks (default 1)")
    rp.add_argument("--seed", type=int, default=0,
                    help="seed of the system prompt each request draws (default 0)")
    rp.add_argument("--data", default=None, help=DATA_HELP)
    rp.add_argument("--out", type=folder, default="bench_out",
                    help="folder for replicas.md and replicas.json (default bench_out)")
    add_engine_args(rp)
    rp.set_defaults(func=run)

    add_spec_parser(kinds).set_defaults(func=run)
    sc = kinds.add_parser("scaling", help="ms per token vs sequence length, cached vs no-cache (PNG)")
    sc.add_argument("--prompt-len", type=at_least(1), default=32,
                    help="prompt tokens of the one sequence timed (default 32)")
    sc.add_argument("--num-tokens", type=at_least(1), default=512,
                    help="tokens generated, each timed, so the context grows from --prompt-len by this many; "
                         "--max-model-len defaults to their sum (default 512)")
    sc.add_argument("--skip-hf", action="store_true", help="leave out HF transformers' cached decoding")
    _hf_dtype_arg(sc)
    sc.add_argument("--skip-llama-cpp", action="store_true", help="leave out llama.cpp (bf16 GGUF)")
    _rounds_arg(sc)
    sc.add_argument("--out", type=folder, default="bench_out",
                    help="folder for scaling.md and scaling.png (default bench_out)")
    add_engine_args(sc)
    sc.set_defaults(func=run)


def _rounds_arg(p: argparse.ArgumentParser) -> None:
    def rounds(text: str) -> int:
        if not text.isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"--rounds must be a whole number >= 1, got {text!r}")
        return int(text)

    p.add_argument("--rounds", type=rounds, default=1,
                   help="run every configuration this many times, taking turns, and report medians: each "
                        "round's ratio to its first configuration, so a machine that drifts between runs "
                        "(a shared CPU can by 10-20%%) moves both sides of a ratio alike (default 1)")


def _hf_dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf-dtype", choices=sorted(DTYPES), default=None,
                   help="dtype HF transformers runs in (default: --dtype, but float32 for bf16 on a CPU without "
                        "AVX512-BF16 or AMX, where its bf16 matmuls are emulated, several times slower: there "
                        "float32 is HF's fastest, the fair peer of kvserve in bf16)")


def _hf_dtype(args: argparse.Namespace) -> torch.dtype:
    return hf_dtype(args.hf_dtype, args.dtype, args.device)


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    {"throughput": run_throughput, "scaling": run_scaling, "memory": run_memory,
     "serve": run_serve, "kv-formats": run_kv_formats, "attention": run_attention,
     "soak": run_soak_bench, "evictions": run_evictions, "replicas": run_replicas,
     "spec": run_spec_bench}[args.bench](args, out)


def run_replicas(args: argparse.Namespace, out: Path) -> None:
    from kvserve.bench.replicas import run_replicas_bench
    run_replicas_bench(args, out)


def run_attention(args: argparse.Namespace, out: Path) -> None:
    from kvserve.bench.attention import format_rows, time_backends

    text = (f"one layer, 9 heads / 3 KV heads, head_dim 64, block 16, bf16, torch threads "
            f"{torch.get_num_threads()}; median of 20 calls (K/V write included)\n\n"
            + format_rows(time_backends(args.formats.split(","))))
    print(text)
    (out / "attention.md").write_text(text + "\n")


def _workload(args: argparse.Namespace, tokenizer: Any,
              **shape: Any) -> tuple[list[Any], list[list[int]], list[Any], str]:
    """The run's requests (slices of the --data text), their prompts, greedy params of fixed
    output length, and the text's name."""
    from kvserve.bench.throughput import greedy_params
    from kvserve.bench.workload import load_text_ids, make_workload

    name, ids = load_text_ids(tokenizer, args.data)
    requests = make_workload(ids, args.num_requests, args.seed, args.prompt_len_median, args.output_len_median,
                             **shape)
    return requests, [r.prompt_token_ids for r in requests], greedy_params(requests), name


def run_throughput(args: argparse.Namespace, out: Path) -> None:
    from kvserve.bench.metrics import summarize
    from kvserve.measure.roofline import measure_machine, pct_of_compute, workload_flops
    from kvserve.bench.throughput import run_kvserve

    llm = llm_from_args(args, "paged")
    model_config = llm.engine.model_config
    requests, prompts, params, _ = _workload(args, llm.tokenizer, sigma=args.sigma,
                                             max_prompt_len=args.max_prompt_len, max_output_len=args.max_output_len)
    summaries = [run_kvserve(llm, prompts, params, "kvserve-paged")]
    backend = llm.engine.attention_backend.name
    if not args.skip_contiguous:
        del llm
        summaries.append(run_kvserve(llm_from_args(args, "contiguous"), prompts, params,
                                     "kvserve-contiguous"))
    source = peer_source(args.model)
    if not args.skip_hf:
        from kvserve.bench.hf_process import HFProcess

        hf = HFProcess(source, _hf_dtype(args), torch.get_num_threads())  # OpenMP's own spin there
        for kind, name in (("static", "hf-static-batches"), ("continuous", "hf-continuous-batching")):
            timings, wall = hf.batches(kind, requests, args.max_num_seqs)
            summaries.append(summarize(name, timings, wall))
        hf.close()
    if not args.skip_llama_cpp and source.endswith(".gguf"):
        from kvserve.bench.llama_cpp import load_llama_cpp, run_llama_cpp_sequential

        lc = load_llama_cpp(Path(source), args.max_model_len, torch.get_num_threads())
        timings, wall = run_llama_cpp_sequential(lc, requests)
        summaries.append(summarize("llama.cpp-bf16-sequential", timings, wall))
    machine = measure_machine(DTYPES[args.dtype])
    flops = workload_flops(model_config, [(len(r.prompt_token_ids), r.max_tokens) for r in requests])
    for summary in summaries:
        summary.extra["pct_compute_roofline"] = pct_of_compute(flops, summary.wall_s, machine)
    table = format_table(summaries)
    report = [f"workload: {len(requests)} requests, seed {args.seed}, prompt median "
              f"{args.prompt_len_median}, output median {args.output_len_median}, sigma {args.sigma}; "
              f"dtype {args.dtype} (HF: {_hf_dtype(args)}), max_num_seqs {args.max_num_seqs}, attention backend "
              f"{backend}, torch threads {torch.get_num_threads()}",
              f"machine, measured now: read {machine.read_gb_s:.1f} GB/s, {args.dtype} matmul "
              f"{machine.matmul_gflop_s:.0f} GFLOP/s; workload {flops / 1e12:.2f} TFLOP useful "
              f"(compute roofline {flops / machine.matmul_gflop_s / 1e9:.1f} s)", "", table, ""]
    for peer in summaries[1:]:
        r = ratio(summaries[0], peer)
        report.append(f"kvserve-paged / {peer.name}: " + ", ".join(f"{k} {v:.2f}x" for k, v in r.items()))
    text = "\n".join(report)
    print(text)
    (out / "throughput.md").write_text(text + "\n")
    (out / "throughput.json").write_text(json.dumps([asdict(s) for s in summaries], indent=2))


def run_scaling(args: argparse.Namespace, out: Path) -> None:
    import statistics
    from collections.abc import Callable

    from kvserve.measure.roofline import decode_step_bytes, measure_machine, pct_of_bandwidth
    from kvserve.bench.scaling import mean_decode_s, median_ratios, plot, time_per_token

    args.max_model_len = args.max_model_len or args.prompt_len + args.num_tokens
    prompt = list(range(100, 100 + args.prompt_len))
    ours, no_cache = "kvserve cached (paged KV)", "kvserve no-cache (recompute)"
    llm = llm_from_args(args, "paged")
    time_per_token(llm, prompt, 8, "warm-up")
    engine = llm.engine
    model_config, kv_bytes, backend = engine.model_config, engine.kv_bytes_per_token, engine.attention_backend.name
    # The series a round times, in turn; each was warmed up once.
    timers: dict[str, Callable[[], list[float]]] = {ours: lambda: time_per_token(llm, prompt, args.num_tokens, ours)}
    source = peer_source(args.model)
    hf = None
    if not args.skip_hf:
        from kvserve.bench.hf_process import HFProcess

        hf = HFProcess(source, _hf_dtype(args), torch.get_num_threads())  # OpenMP's own spin there
        hf.step_times(prompt, 8)  # warm-up, as kvserve's first run warms its kernels
        timers[f"HF transformers (DynamicCache, {_hf_dtype(args)}, own process)"] = \
            lambda: hf.step_times(prompt, args.num_tokens)
    if not args.skip_llama_cpp and source.endswith(".gguf"):
        from kvserve.bench.llama_cpp import llama_cpp_step_times, load_llama_cpp

        lc = load_llama_cpp(Path(source), args.max_model_len + 8, torch.get_num_threads())
        llama_cpp_step_times(lc, prompt, 8, "warm-up")
        timers["llama.cpp (bf16 GGUF)"] = lambda: llama_cpp_step_times(lc, prompt, args.num_tokens)
    series: dict[str, list[float]] = {}  # each series' first run, for the plot
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        if args.rounds > 1:
            print(f"round {r + 1} of {args.rounds}", flush=True)
        runs = {name: timer() for name, timer in timers.items()}
        rounds.append({name: mean_decode_s(times) for name, times in runs.items()})
        for name, times in runs.items():
            series.setdefault(name, times)
    if hf is not None:
        hf.close()
    # Recompute is the curve the plot contrasts, ~30x slower: timed once, outside the rounds.
    no_cache_llm = llm_from_args(args, "no-cache")
    time_per_token(no_cache_llm, prompt, 8, "warm-up")
    series[no_cache] = time_per_token(no_cache_llm, prompt, args.num_tokens, no_cache)
    machine = measure_machine(DTYPES[args.dtype])
    # Mean decode step (the first token includes the prefill) and the bytes it must read at the
    # mean context length, against the read bandwidth measured now.
    mean_ctx = args.prompt_len + args.num_tokens / 2
    bytes_per_step = decode_step_bytes(model_config, DTYPES[args.dtype], int(mean_ctx), kv_bytes)
    lines = [f"one stream, prompt {args.prompt_len}, {args.num_tokens} tokens, {args.dtype}, attention backend "
             f"{backend}, torch threads {torch.get_num_threads()}, {args.rounds} round(s) taking turns; machine "
             f"now: read {machine.read_gb_s:.1f} GB/s; a decode step reads >= {bytes_per_step / 1e6:.0f} MB", "",
             "| series | decode ms/token (median of rounds' means) | tok/s | % of read bandwidth | each round, ms |",
             "|---|---|---|---|---|"]
    decode = {name: statistics.median(r[name] for r in rounds) for name in timers}
    decode[no_cache] = mean_decode_s(series[no_cache])
    for name, step_s in decode.items():
        each = ", ".join(f"{r[name] * 1e3:.2f}" for r in rounds) if name in timers else "one run"
        lines.append(f"| {name} | {step_s * 1e3:.2f} | {1 / step_s:.1f} | "
                     f"{pct_of_bandwidth(bytes_per_step, step_s, machine):.0f}% | {each} |")
    lines.append("")
    lines += [f"kvserve cached / {name}: {ratio:.2f}x tokens/s"
              + (f" (median of rounds: {', '.join(f'{r[name] / r[ours]:.2f}' for r in rounds)})"
                 if args.rounds > 1 else "") for name, ratio in median_ratios(rounds, ours).items()]
    lines.append(f"kvserve cached / {no_cache}: {decode[no_cache] / decode[ours]:.2f}x tokens/s")
    text = "\n".join(lines)
    print(text)
    (out / "scaling.md").write_text(text + "\n")
    path = out / "scaling.png"
    plot(args.prompt_len, series, path)


def run_memory(args: argparse.Namespace, out: Path) -> None:
    from functools import partial

    from kvserve import LLM
    from kvserve.bench import memory
    from kvserve.bench.workload import load_text_ids

    make_llm = partial(LLM, model=args.model, dtype=args.dtype, device=args.device,
                       block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                       max_model_len=args.max_model_len)
    _, ids = load_text_ids(make_llm(kv_cache_memory="16MiB").tokenizer, args.data)
    sections = []
    for title, experiment in (("(a) shared system prompt", memory.shared_system_prompt),
                              ("(b) parallel samples", memory.parallel_samples),
                              ("(c) preemption under memory pressure", memory.preemption_modes),
                              ("(d) a sequence 4x the device KV pool", memory.long_sequence_offload)):
        on, off = experiment(make_llm, ids)
        r = ratio(on, off)
        sections += [f"### {title}", "", format_table([on, off]), "",
                     f"{on.name} / {off.name}: " + ", ".join(f"{k} {v:.2f}x" for k, v in r.items())
                     + f", peak KV {on.extra['peak_kv_mib'] / off.extra['peak_kv_mib']:.2f}x", ""]
    beams = memory.beam_search(make_llm, ids)
    sections += ["### (b') beam search", "", format_table([beams]), "",
                 f"peak KV with sharing {beams.extra['peak_kv_mib']:.2f} MiB, the same block tables "
                 f"unshared {beams.extra['peak_kv_unshared_mib']:.2f} MiB: "
                 f"{beams.extra['peak_kv_unshared_mib'] / beams.extra['peak_kv_mib']:.2f}x saved", ""]
    text = "\n".join([f"dtype {args.dtype}, max_num_seqs {args.max_num_seqs}, block size "
                      f"{args.block_size}, torch threads {torch.get_num_threads()}", ""] + sections)
    print(text)
    (out / "memory.md").write_text(text + "\n")


def run_serve(args: argparse.Namespace, out: Path) -> None:
    from kvserve.bench.serve_load import run_serve_bench
    run_serve_bench(args, llm_from_args(args, "paged"), out)


def run_soak_bench(args: argparse.Namespace, out: Path) -> None:
    """`kvserve serve` under a long mixed load; its RSS over time, flat or not."""
    from kvserve import LLM
    from kvserve.bench.serve_load import ServerProcess
    from kvserve.bench.soak import run_soak

    tokenizer = LLM(model=args.model, dtype=args.dtype, kv_cache_memory="16MiB").tokenizer
    requests, _, _, text_name = _workload(args, tokenizer, max_prompt_len=512, max_output_len=128)
    engine_args = ["--dtype", args.dtype, "--device", args.device, "--kv-cache-memory", str(args.kv_cache_memory),
                   "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
                   "--max-waiting", str(4 * args.concurrency), *(["--model", args.model] if args.model else [])]
    server = ServerProcess(*engine_args)
    try:
        result = run_soak(server.url, server.proc.pid, requests, args.concurrency, args.duration, args.hangup,
                          args.sample, args.seed)
        state = server.kv_state()
    finally:
        server.stop()
    lines = [f"soak: {args.duration:.0f} s, {args.concurrency} clients, {100 * args.hangup:.0f}% hanging up, "
             f"{text_name} prompts (median {args.prompt_len_median}, outputs median {args.output_len_median}); "
             f"requests {result['counts']}; KV blocks in use afterwards: {sum(c in 'US' for c in state['states'])}",
             "", "| seconds | server RSS MiB |", "|---|---|",
             *(f"| {t:.0f} | {m:,.0f} |" for t, m in result["rss_mib"]), "",
             f"RSS growth from the first sample after a fifth of the run to the end: "
             f"{100 * result['growth_after_warmup']:+.1f}%"]
    text = "\n".join(lines)
    print(text)
    (out / "soak.md").write_text(text + "\n")
    (out / "soak.json").write_text(json.dumps(result, indent=2))


def run_kv_formats(args: argparse.Namespace, out: Path) -> None:
    """The same workload and KV budget per format: how many sequences run at once, how fast."""
    runs = [(fmt, kv_format_overrides(fmt, args)) for fmt in args.formats.split(",")]
    _same_budget_runs(args, runs, "format", out / "kv_formats.md", max_prompt_len=1024)


def run_evictions(args: argparse.Namespace, out: Path) -> None:
    """The same long-context workload and KV budget per eviction policy, against none."""
    runs = [(p if p == "none" else f"{p} @{args.kv_budget}", {"kv_eviction": p}) for p in args.policies.split(",")]
    _same_budget_runs(args, runs, "eviction", out / "evictions.md", max_prompt_len=args.max_model_len // 2)


def _same_budget_runs(args: argparse.Namespace, runs: list[tuple[str, dict[str, Any]]], what: str, path: Path,
                      max_prompt_len: int) -> None:
    from kvserve.bench.throughput import run_kvserve

    rounds: list[list[Any]] = []
    prompts: list[list[int]] = []
    for r in range(args.rounds):
        summaries = []
        for name, overrides in runs:
            llm = llm_from_args(args, "paged", **overrides)  # a fresh engine: no prefix cache kept from a round
            if not prompts:  # the tokenizer comes with the first engine
                _, prompts, params, _ = _workload(args, llm.tokenizer, sigma=0.5, max_prompt_len=max_prompt_len,
                                                  max_output_len=max(512, 2 * args.output_len_median))
            llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
            label = f"kvserve {name}" + (f" (round {r + 1})" if args.rounds > 1 else "")
            summary = run_kvserve(llm, prompts, params, label)
            summary.extra["capacity_tokens"] = float(llm.engine.block_manager.num_blocks * args.block_size)
            summary.extra["kv_bytes_per_token"] = llm.engine.kv_bytes_per_token
            summaries.append(summary)
            del llm
        rounds.append(summaries)
    lines = [f"KV budget {args.kv_cache_memory}, {args.num_requests} requests (prompt median "
             f"{args.prompt_len_median}, output median {args.output_len_median}, sigma 0.5), dtype {args.dtype}, "
             f"max_num_seqs {args.max_num_seqs}, torch threads {torch.get_num_threads()}, "
             f"{args.rounds} round(s)", "", format_table([s for r in rounds for s in r]), "",
             same_budget_table([f"kvserve {name}" for name, _ in runs], rounds, what)]
    text = "\n".join(lines)
    print(text)
    path.write_text(text + "\n")
