"""Gemma 3 270M through the hybrid KV cache (issue 41): `python benchmarks/gemma3_hybrid.py [memory|speed|llama|all]`.

memory (nothing timed): with bf16 pages, for each `--lengths` context (default 8k and 32k),
- KV bytes per token, hybrid (15 sliding layers give back what their 512-token window has passed)
  against every layer full (`disable_hybrid_kv_cache=True`), from the engines themselves: a block's
  bytes (the pool's bytes / its blocks) x the blocks a sequence of that length holds
  (`BlockManager.blocks_held`), next to `kvserve memory --preset gemma-3-270m`'s figure;
- sequences of that length one `--budget` (default 1 GiB) holds: the pool's capacity // blocks held;
- live (`--live`, default 8k): one real sequence prefilled in the default chunks and decoded to the
  length, its blocks counted per group (`group_blocks()`) at its last decode step, and the pool's
  peak (the chunked prefill's transient: a sliding group holds its window plus the next chunk);
- verified (`--verify-len`, `--verify-budget`): a real run at a smaller budget and length, as many
  distinct requests as the capacity predicts plus one, each a few tokens past its prompt: how many
  ran their decode at once, and the preemptions (prefix caching off, so no request shares blocks).

speed (timed, peers in the same run taking turns, `--rounds`): one stream's mean decode step of
kvserve (bf16 weights dequantized from the Q4_K_M GGUF, hybrid on and off) against HF transformers
on the same dequantized weights (kvserve's conversion of the GGUF; `DynamicCache`, which keeps
only the window in sliding layers too), fp32 and bf16, each in a process of its own with OpenMP's
default spin (bench/hf_process.py), and llama.cpp (llama-cpp-python) on the same weights as a bf16
GGUF (`bench/llama_cpp.py bf16_gguf`: the Q4_K_M GGUF requantized to bf16) and on the Q4_K_M GGUF
itself (a reference row: it reads ~3x fewer weight bytes). The ratios are against HF's faster dtype
and llama.cpp bf16. llama.cpp is reported absent when `llama_cpp` is not installed (this script
does not install it). `llama`: the same with HF left out (`--skip-hf`).

Results go to stdout and `--out` (markdown).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvserve import LLM, SamplingParams  # before torch: kvserve sets OpenMP's spin (threads.py)

import torch  # noqa: E402
from kvserve.diagnostics.kv_group_pricing import KVLayout, sequence_price
from kvserve.kernels import cpu_extension
from kvserve.model.config import PRESETS
from kvserve.model.named_models import named_model_path

MODEL = "gemma3-270m"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
MiB = 2**20


def parse_size(text: str) -> int:
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * scale)
    return int(text)


def machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    isa = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)
    load = os.getloadavg()
    return (f"{fields.get('Model name', '?').strip()}, {os.cpu_count()} CPUs ({isa}); torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads; python {platform.python_version()}; load average at start "
            f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (a shared machine: other work runs beside)")


def source_state() -> str:
    """The commit, and a hash of kvserve's sources as they are now (uncommitted edits included)."""
    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "kvserve"], cwd=root, capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for path in sorted((root / "kvserve").rglob("*")):
        if path.suffix in (".py", ".cpp", ".h") and path.is_file():
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return (f"commit {head.strip()}{', with uncommitted changes under kvserve/' if dirty else ''}; "
            f"sources sha256 {digest.hexdigest()[:12]}")


def llama_cpp_model(path: Path, n_ctx: int, threads: int) -> object:
    """llama-cpp-python on `path` with llama.cpp's window-sized SWA cache (`swa_full=False`; the
    library's default keeps a full-size one). A quantized GGUF loads without the extra buffer types
    (`use_extra_bufts=False`): with them, llama-cpp-python 0.3.36 built here repacks the Q4_K_M
    file's q8_0/q4_K/q6_K tensors for AMX and segfaults in its first `llama_decode`."""
    import llama_cpp
    import llama_cpp.llama_cpp as low  # the module Llama() reads its default model parameters from

    default = low.llama_model_default_params
    if "bf16" not in path.name:
        def no_extra_bufts() -> object:
            params = default()
            params.use_extra_bufts = False
            return params
        low.llama_model_default_params = no_extra_bufts
    try:
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                               n_batch=512, swa_full=False, verbose=False)
    finally:
        low.llama_model_default_params = default


def engine(hybrid: bool, budget: int, **kwargs: object) -> LLM:
    return LLM(model=MODEL, dtype="bfloat16", device="cpu", kv_cache_memory=f"{budget}", max_model_len=32768,
               disable_hybrid_kv_cache=not hybrid, **kwargs)


def filler_prompt(llm: LLM, length: int, salt: int = 0) -> list[int]:
    """`length` token ids of filler text, different for each `salt` from its first block on."""
    ids = llm.tokenizer(f"Document {salt}. " + FILLER * (length // 20 + 2)).input_ids
    assert len(ids) >= length
    return ids[:length]


def block_bytes(llm: LLM) -> int:
    pool = llm.engine.pool
    return pool.nbytes // pool.num_blocks


def live_sequence(llm: LLM, length: int, decode: int = 8) -> dict[str, object]:
    """One sequence of `length - decode` prompt tokens decoded `decode` tokens: the blocks each
    group held at its last decode step (`length - 1` tokens in, the last token's slot written),
    and the pool's peak over the run."""
    engine = llm.engine
    bm = engine.block_manager
    bm.peak_used = 0
    engine.add_request(filler_prompt(llm, length - decode), SamplingParams(max_tokens=decode, temperature=0,
                                                                             ignore_eos=True), request_id="live")
    last: tuple[int, list[int]] = (0, [])
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        if "live" in bm.num_tokens:
            last = (bm.num_tokens["live"], bm.group_blocks())
    tokens, groups = last
    return {"tokens": tokens, "groups": groups, "blocks": sum(groups), "formula": bm.blocks_held(tokens),
            "peak": bm.peak_used, "seconds": time.perf_counter() - start}


def verify_fit(hybrid: bool, budget: int, length: int, decode: int = 32) -> dict[str, object]:
    """As many distinct `length`-token requests (`decode` of them generated) as the capacity
    predicts, plus one, at once. `decode` outlasts the others' prefills (each 512-token chunk a
    step), so that every admitted sequence decodes at the same time as the others."""
    llm = engine(hybrid, budget, enable_prefix_caching=False, max_num_seqs=64)
    eng, bm = llm.engine, llm.engine.block_manager
    predicted = bm.capacity // bm.blocks_held(length)
    prompts = [filler_prompt(llm, length - decode, salt=i) for i in range(predicted + 1)]
    params = SamplingParams(max_tokens=decode, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        eng.add_request(prompt, params, request_id=f"v{i}")
    most_decoding = most_running = 0
    preempted: dict[str, int] = {}
    start = time.perf_counter()
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                preempted[out.request_id] = out.num_preemptions
        running = eng.scheduler.running
        decoding = sum(s.num_computed_tokens >= len(s.prompt_token_ids) for s in running)
        most_decoding, most_running = max(most_decoding, decoding), max(most_running, len(running))
    result = {"hybrid": hybrid, "capacity": bm.capacity, "held": bm.blocks_held(length), "predicted": predicted,
              "requests": len(prompts), "most_decoding": most_decoding, "most_running": most_running,
              "preemptions": eng.scheduler.num_preemptions,
              "per_request": [preempted[f"v{i}"] for i in range(len(prompts))], "peak": bm.peak_used,
              "seconds": time.perf_counter() - start}
    del llm, eng, bm
    gc.collect()
    return result


def memory(args: argparse.Namespace) -> list[str]:
    preset = PRESETS["gemma-3-270m"]
    layout = KVLayout("bf16", block_size=16)
    budget = parse_size(args.budget)
    lines = [f"## memory: bf16 pages, blocks of 16 tokens, budget {args.budget}", ""]
    rows: dict[tuple[int, bool], dict[str, object]] = {}
    for hybrid in (True, False):
        llm = engine(hybrid, budget)
        bm, per_block = llm.engine.block_manager, block_bytes(llm)
        kind = "hybrid" if hybrid else "every layer full"
        lines.append(f"- {kind}: {llm.engine.kv_groups.describe() if hybrid else 'one group of 18 layers'}; "
                     f"a block holds {llm.engine.kv_groups.layers_per_block} layers' pages = {per_block:,} bytes; "
                     f"pool {llm.engine.pool.nbytes / MiB:,.1f} MiB = {bm.num_blocks:,} blocks, capacity "
                     f"{bm.capacity:,}{' (block 0: the null block)' if bm.reserved else ''}; "
                     f"engine.kv_bytes_per_token reports {llm.engine.kv_bytes_per_token:,.0f}")
        for length in args.lengths:
            held = bm.blocks_held(length)
            price = sequence_price(preset, layout, length, hybrid=hybrid)
            row = {"held": held, "bytes": held * per_block, "fit": bm.capacity // held, "planner": price.held}
            if length in args.live:
                row["live"] = live_sequence(llm, length)
            rows[length, hybrid] = row
        del llm, bm
        gc.collect()
    lines += ["", "| context | cache | blocks held | KV bytes / sequence | KV bytes / token | kvserve memory "
              "(planner) bytes / token | sequences in the budget (capacity // held) |", "|---|---|---|---|---|---|---|"]
    for length in args.lengths:
        for hybrid in (True, False):
            row = rows[length, hybrid]
            lines.append(f"| {length:,} | {'hybrid' if hybrid else 'every layer full'} | {row['held']:,} | "
                         f"{row['bytes']:,} | {row['bytes'] / length:,.0f} | {row['planner'] / length:,.0f} | "
                         f"{row['fit']} |")
        on, off = rows[length, True], rows[length, False]
        lines.append(f"| {length:,} | **hybrid / full** | | | **{on['bytes'] / off['bytes']:.3f}** "
                     f"({off['bytes'] / on['bytes']:.2f}x less) | | **{on['fit']} vs {off['fit']}** |")
    lives = [(length, hybrid, row["live"]) for (length, hybrid), row in rows.items() if "live" in row]
    if lives:
        lines += ["", "Live: one real sequence prefilled in 512-token chunks, then decoded; blocks per group at its "
                      "last decode step (group 0: the full layers 5, 11, 17; groups 1-5: three sliding layers each)",
                  "", "| context | cache | tokens in | blocks per group | blocks | blocks_held(tokens in) | "
                      "KV bytes / token | pool peak (blocks) | run (s) |", "|---|---|---|---|---|---|---|---|---|"]
        for length, hybrid, live in lives:
            row = rows[length, hybrid]
            per_block = row["bytes"] // row["held"]
            lines.append(f"| {length:,} | {'hybrid' if hybrid else 'every layer full'} | {live['tokens']:,} | "
                         f"{live['groups']} | {live['blocks']:,} | {live['formula']:,} | "
                         f"{live['blocks'] * per_block / live['tokens']:,.0f} | {live['peak']:,} | "
                         f"{live['seconds']:.0f} |")
    if args.verify_len:
        lines += ["", f"Verified at a smaller budget ({args.verify_budget}) and length ({args.verify_len:,} tokens): "
                      "predicted + 1 distinct requests at once, each 32 tokens decoded after its prompt, prefix "
                      "caching off",
                  "", "| cache | capacity (blocks) | held per sequence | predicted | requests | most decoding at once "
                      "| most running at once | preemptions (per request) | pool peak | run (s) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for hybrid in (True, False):
            v = verify_fit(hybrid, parse_size(args.verify_budget), args.verify_len)
            lines.append(f"| {'hybrid' if hybrid else 'every layer full'} | {v['capacity']:,} | {v['held']} | "
                         f"{v['predicted']} | {v['requests']} | {v['most_decoding']} | {v['most_running']} | "
                         f"{v['preemptions']} ({', '.join(map(str, v['per_request']))}) | {v['peak']:,} | "
                         f"{v['seconds']:.0f} |")
    return lines


def speed(args: argparse.Namespace) -> list[str]:
    from kvserve.bench.hf_process import HFProcess
    from kvserve.bench.llama_cpp import llama_cpp_step_times
    from kvserve.bench.scaling import mean_decode_s, time_per_token
    from kvserve.measure.roofline import decode_step_bytes, measure_machine

    source = str(named_model_path(MODEL))
    threads = torch.get_num_threads()
    llms = {}
    for hybrid in (True, False):
        name = f"kvserve bf16, hybrid {'on' if hybrid else 'off'}"
        llms[name] = LLM(model=MODEL, dtype="bfloat16", device="cpu", kv_cache_memory="256MiB",
                         max_model_len=max(args.prompt_lens) + args.num_tokens + 16, disable_hybrid_kv_cache=not hybrid)
    hfs = {} if args.skip_hf else {f"HF transformers {dtype} (own process)": HFProcess(source, getattr(torch, dtype),
                                                                                     threads)
                                    for dtype in ("float32", "bfloat16")}
    kernels = cpu_extension.load()
    lines = [f"## speed: one stream, {args.num_tokens} greedy tokens, {args.rounds} rounds taking turns, "
             f"{threads} torch threads; kvserve CPU kernels {'loaded' if kernels is not None else 'NOT loaded'}; "
             f"attention backend {next(iter(llms.values())).engine.attention_backend.name}", ""]
    lcs, n_ctx = {}, max(args.prompt_lens) + args.num_tokens + 16
    if args.skip_llama_cpp:
        lines.append("llama.cpp: left out (--skip-llama-cpp)")
    elif importlib.util.find_spec("llama_cpp") is None:
        lines.append("llama.cpp: not installed (no `llama_cpp` module): no llama.cpp row")
    else:
        from importlib.metadata import version

        from kvserve.bench.llama_cpp import bf16_gguf

        for label, path in (("bf16 GGUF", bf16_gguf(Path(source))), ("Q4_K_M GGUF, reference", Path(source))):
            lcs[f"llama.cpp {label}"] = llama_cpp_model(path, n_ctx, threads)
            lines.append(f"llama.cpp {label}: llama-cpp-python {version('llama_cpp_python')}, {path.name} "
                         f"({path.stat().st_size / MiB:,.0f} MiB), n_threads {threads}, n_batch 512, swa_full False"
                         + ("" if "bf16" in path.name else ", use_extra_bufts False (see llama_cpp_model)"))
    lines.append("")
    for prompt_len in args.prompt_lens:
        prompt = filler_prompt(next(iter(llms.values())), prompt_len)
        timers = {name: (lambda llm=llm: time_per_token(llm, prompt, args.num_tokens, name))
                  for name, llm in llms.items()}
        timers |= {name: (lambda hf=hf: hf.step_times(prompt, args.num_tokens)) for name, hf in hfs.items()}
        timers |= {name: (lambda lc=lc: llama_cpp_step_times(lc, prompt, args.num_tokens, progress=False))
                   for name, lc in lcs.items()}
        for name in llms:  # warm-up: kernels, caches, the first prefill
            time_per_token(llms[name], prompt, 4, "warm-up")
        for hf in hfs.values():
            hf.step_times(prompt, 4)
        for lc in lcs.values():
            llama_cpp_step_times(lc, prompt, 4, progress=False)
        rounds = []
        for r in range(args.rounds):
            rounds.append({name: mean_decode_s(timer()) for name, timer in timers.items()})
            print(f"prompt {prompt_len}, round {r + 1}: " + ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in
                                                                       rounds[-1].items()), flush=True)
        ours = "kvserve bf16, hybrid on"
        bandwidth = measure_machine(torch.bfloat16).read_gb_s
        cfg = llms[ours].engine.model_config
        context = prompt_len + args.num_tokens // 2  # the mean context of a timed step; sliding layers read their window
        kv_read = sum(min(context, w or context) for w in cfg.layer_windows) * 2 * cfg.num_kv_heads * cfg.head_dim * 2
        step_bytes = decode_step_bytes(cfg, torch.bfloat16, 0, 0) + kv_read
        lines += [f"Prompt {prompt_len:,} tokens, then {args.num_tokens} decode steps (the first token, with the "
                  f"prefill, left out):", "", "| series | decode ms/token (median of rounds) | tok/s | each round, ms "
                  "| kvserve hybrid on / this, tok/s (median of rounds' ratios) |", "|---|---|---|---|---|"]
        for name in timers:
            med = statistics.median(r[name] for r in rounds)
            ratio = statistics.median(r[name] / r[ours] for r in rounds)
            lines.append(f"| {name} | {med * 1e3:.2f} | {1 / med:.1f} | "
                         f"{', '.join(f'{r[name] * 1e3:.1f}' for r in rounds)} | {ratio:.2f}x |")
        lines.append("")
        if hfs:
            best = min(hfs, key=lambda n: statistics.median(r[n] for r in rounds))
            ratio = statistics.median(r[best] / r[ours] for r in rounds)
            lines.append(f"HF's faster dtype here: {best}; kvserve (bf16, hybrid on) / it: **{ratio:.2f}x** tokens/s")
        for name in lcs:
            ratio = statistics.median(r[name] / r[ours] for r in rounds)
            lines.append(f"kvserve (bf16, hybrid on) / {name}: **{ratio:.2f}x** tokens/s"
                         + (" (target >= 1.0x: " + ("met" if ratio >= 1 else "NOT met") + ")" if "bf16" in name else ""))
        lines += [f"A decode step at {prompt_len:,} tokens reads >= {step_bytes / 1e6:.0f} MB in bf16 (weights + KV); "
                  f"read bandwidth measured after the rounds: {bandwidth:.1f} GB/s, so >= {step_bytes / bandwidth / 1e6:.1f} "
                  f"ms/token; kvserve hybrid on at {step_bytes / statistics.median(r[ours] for r in rounds) / 1e9 / bandwidth:.0%} "
                  f"of it", ""]
    for hf in hfs.values():
        hf.close()
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("part", nargs="?", choices=["memory", "speed", "llama", "all"], default="all")
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    p.add_argument("--lengths", type=ints, default="8192,32768", help="contexts priced (default 8192,32768)")
    p.add_argument("--budget", default="1GiB", help="KV budget the fits are counted in (default 1GiB)")
    p.add_argument("--live", type=ints, default="8192",
                   help="contexts a real sequence is run to, hybrid and full (default 8192; 32768 takes 3 min "
                        "a run on 2 quiet cores)")
    p.add_argument("--verify-len", type=int, default=2048, help="length of the verifying run (0: none; default 2048)")
    p.add_argument("--verify-budget", default="64MiB", help="budget of the verifying run (default 64MiB)")
    p.add_argument("--prompt-lens", type=ints, default="32,2048", help="speed: prompt lengths (default 32,2048)")
    p.add_argument("--num-tokens", type=int, default=64, help="speed: decode tokens timed per run (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="speed: rounds taking turns (default 3)")
    p.add_argument("--skip-hf", action="store_true", help="speed: leave out HF transformers (`llama` sets it)")
    p.add_argument("--skip-llama-cpp", action="store_true", help="speed: leave out llama.cpp")
    p.add_argument("--out", type=Path, default=None, help="markdown file for the results (default: stdout only)")
    args = p.parse_args()
    if args.part == "llama":
        args.part, args.skip_hf = "speed", True
    lines = [f"# Gemma 3 270M, hybrid KV cache: `python {' '.join(sys.argv)}`", "",
             f"Machine: {machine()}", f"Tree: {source_state()}",
             f"Model: {named_model_path(MODEL).name} (dequantized; kvserve runs it in bf16)", ""]
    print("\n".join(lines), flush=True)
    for part, run in (("memory", memory), ("speed", speed)):
        if args.part in (part, "all"):
            section = run(args) + [""]
            print("\n".join(section), flush=True)
            lines += section
    text = "\n".join(lines)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
