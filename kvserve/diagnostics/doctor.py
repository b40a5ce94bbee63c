"""`kvserve doctor`: the article's checklist (sections 5.2 and 5.3) run on the configured engine.

"Quality dropped after enabling the cache" -> the correctness checks, each comparing the cache
with a recomputation through the same engine; "the cache gives no speed-up" -> where a decode
step's time goes and how close it runs to the machine's limits. Every weak result comes with
the option that addresses it. Exit status 1 when a correctness check fails.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from kvserve.arg_types import at_least, folder
from kvserve.cache.quantized_pool import QuantizedKVPool
from kvserve.diagnostics import checks, performance
from kvserve.diagnostics.checks import Check
from kvserve.engine_args import add_engine_args, llm_from_args
from kvserve.huge_pages import huge_page_mib, thp_mode
from kvserve.texts import DATA_HELP, load_text

DEFAULT_FORMATS = ("int8", "fp8_e4m3", "int4", "kivi4")
# Engine options for pages in the model dtype, whatever KV format is configured.
DENSE_PAGES: dict[str, Any] = dict(kv_cache_dtype="auto", kv_cache_dtype_k=None, kv_cache_dtype_v=None)
# Prompt tokens before the forced continuation each consistency check decodes.
_PROMPT_LEN = 32
T = TypeVar("T")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("doctor", help="check the KV cache's correctness and find where the time goes",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=at_least(1), default=256, help="tokens decoded per consistency check (default 256)")
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                   help=f"KV formats to compare with the model dtype ('' skips; default {','.join(DEFAULT_FORMATS)})")
    p.add_argument("--skip-performance", action="store_true", help="correctness checks only")
    p.add_argument("--data", default=None, help=DATA_HELP)
    p.add_argument("--json", action="store_true", help="print the report as JSON (checks, performance)")
    p.add_argument("--out", type=folder, default=None, help="also write doctor.json and doctor.md into this folder")
    add_engine_args(p)
    p.set_defaults(func=cmd_doctor, kv_cache_memory="256MiB")


def cmd_doctor(args: argparse.Namespace) -> None:
    report = run_doctor(args)
    text = json.dumps(report, indent=2) if args.json else format_report(report)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "doctor.json").write_text(json.dumps(report, indent=2))
        (out / "doctor.md").write_text(format_report(report) + "\n")
    if any(c["status"] == "fail" and c["correctness"] for c in report["checks"]):
        raise SystemExit(1)


def sample_tokens(llm: Any, n: int, spec: str | None) -> tuple[str, list[int]]:
    """n token ids of real text (or a fixed varied sequence for a model without a tokenizer)."""
    if llm.tokenizer is None:
        vocab = llm.engine.model_config.vocab_size
        return "synthetic ids", [(7 * i * i + 3 * i + 11) % vocab for i in range(n)]
    text = load_text(spec, max_chars=16 * n + 1000)
    ids = llm.tokenizer.encode(text.text, add_special_tokens=False)
    if len(ids) < n:
        raise ValueError(f"--data: {text.name} holds {len(ids)} tokens, fewer than --tokens {n}")
    return text.name, ids[:n]


class Progress:
    """A line on stderr as each of the doctor's steps starts and ends, and one every `period`
    seconds while a long one runs, so a run on a busy machine is never silent for long (a total
    of 0: the steps are not numbered)."""

    def __init__(self, total: int, period: float = 30.0) -> None:
        self.total, self.period, self.done = total, period, 0

    def run(self, label: str, step: Callable[[], T]) -> T:
        self.done += 1
        head = f"kvserve doctor [{self.done}/{self.total}] {label}" if self.total else f"kvserve doctor: {label}"
        print(f"{head} ...", file=sys.stderr, flush=True)
        start, finished = time.perf_counter(), threading.Event()

        def tick() -> None:
            while not finished.wait(self.period):
                print(f"{head}: running, {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)

        threading.Thread(target=tick, daemon=True).start()
        try:
            result = step()
        finally:
            finished.set()
        status = result.status if isinstance(result, Check) else "done"
        print(f"{head}: {status} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        return result


def run_doctor(args: argparse.Namespace) -> dict[str, Any]:
    def make_llm(**overrides: Any) -> Any:
        return llm_from_args(args, **overrides)

    formats = [f for f in args.formats.split(",") if f]
    llm = Progress(total=0).run("load the model", make_llm)
    engine = llm.engine
    n = min(args.tokens + _PROMPT_LEN, engine.max_model_len - 1)
    source, tokens = sample_tokens(llm, n, args.data)
    prompt_len = min(_PROMPT_LEN, n // 2)
    compressed = engine.config.kv_format.kv_cache_dtype not in ("auto", engine.config.model.dtype) or \
        engine.config.kv_format.kv_cache_dtype_k is not None or engine.config.kv_format.kv_cache_dtype_v is not None
    dense = make_llm(**DENSE_PAGES) if compressed else llm
    short = tokens[:max(prompt_len + 16, min(n, 96))]
    truth = truth_short = truth_scores = None
    half = engine.config.model.torch_dtype != torch.float32
    progress = Progress(total=half + compressed + 7 + len(formats) + (0 if args.skip_performance else 2))

    def fp32_truth() -> tuple[torch.Tensor, ...]:
        fp32 = make_llm(dtype="float32", **DENSE_PAGES)
        return tuple(checks.prompt_scores(fp32, [tokens]))  # causal: its first rows are `short`'s too

    if half:  # half precision is judged against fp32 (see checks)
        (scores,) = progress.run("fp32 recompute (the reference for half precision)", fp32_truth)
        truth, truth_scores = scores[prompt_len - 1:], scores[:len(short) - 1]
        truth_short = truth[:len(short) - prompt_len]
    # A hit of a format with a full-precision residual window reads codes its miss read exactly:
    # judged against a recompute by KL even in fp32, where the other checks compare directly.
    staged = isinstance(engine.pool, QuantizedKVPool) and engine.pool.staged
    hit_truth = truth if truth is not None or not staged else checks.recomputed(dense, tokens, prompt_len)
    steps: list[tuple[str, Callable[[], Check]]] = [
        ("cache vs recompute", lambda: checks.cache_vs_recompute(dense, tokens, prompt_len, "model dtype pages",
                                                                 truth))]
    if compressed:
        steps.append(("kernel vs reference, configured format", lambda: checks.kernel_vs_reference(
            llm, make_llm, tokens, prompt_len, truth)))
    steps += [
        ("prefix hit vs miss", lambda: checks.prefix_hit_vs_miss(llm, make_llm, tokens, prompt_len, hit_truth)),
        ("preempted vs undisturbed", lambda: checks.preempted_vs_undisturbed(
            llm, make_llm, short, prompt_len, truth_short, 10 if compressed else 1)),
        ("mask", lambda: checks.mask_future_tokens(llm, short)),
        ("batch invariance", lambda: checks.batch_invariance(llm, short, [tokens[i:i + 40] for i in (5, 17, 29)],
                                                             truth_scores)),
        ("beam rescoring", lambda: checks.beam_rescoring(llm, short[:prompt_len]))]
    found = [progress.run(label, step) for label, step in steps]
    if formats:
        reference = checks.cached(dense, tokens[:prompt_len], tokens[prompt_len:])
        found += [progress.run(f"format {f}", partial(checks.format_quality, make_llm, reference, tokens,
                                                      prompt_len, f)) for f in formats]
    found.append(progress.run("pool capacity", partial(capacity, engine)))
    report: dict[str, Any] = {"model": engine.model_name, "dtype": engine.config.model.dtype,
                              "kv_cache_dtype": engine.config.kv_format.kv_cache_dtype,
                              "attention_backend": engine.attention_backend.name, "text": source,
                              "kv_cache_groups": engine.kv_groups.describe(),
                              "checks": [asdict(c) for c in found]}
    if not args.skip_performance:
        report["performance"] = perf = {
            "decode": progress.run("decode step profile", partial(
                performance.decode_profile, llm, min(8, engine.config.scheduler.max_num_seqs), short, steps=10)),
            "batching": progress.run("batch fill", partial(
                performance.batch_efficiency, llm, [tokens[i:i + 16 + 8 * i] for i in range(8)],
                [8 + 4 * (i % 3) for i in range(8)]))}
        perf["huge_pages"] = {"mode": thp_mode(), "resident_mib": huge_page_mib()}
        report["performance"]["advice"] = performance_advice(perf)
    return report


def capacity(engine: Any) -> Check:
    """Whether max_num_seqs sequences of max_model_len fit the pool (the planner's question)."""
    bm, max_num_seqs = engine.block_manager, engine.config.scheduler.max_num_seqs
    tokens = bm.capacity * bm.block_size
    want = max_num_seqs * engine.max_model_len
    # A hybrid model's sequence holds its full groups' blocks and its sliding groups' windows.
    fits = bm.capacity // bm.blocks_held(engine.max_model_len)
    measured = {"pool_tokens": float(tokens), "max_num_seqs_x_max_model_len": float(want),
                "sequences_of_max_model_len": float(fits), "kv_cache_groups": float(len(bm.specs)),
                "host_offload_tokens": float(bm.num_host_blocks * bm.block_size)}
    if fits >= max_num_seqs:
        return Check("KV pool capacity", "pass", measured, "max_num_seqs x max_model_len fit", correctness=False)
    block_bytes = engine.kv_bytes_per_token * bm.block_size * engine.kv_groups.layers_per_block / \
        engine.model_config.num_layers
    need = max_num_seqs * bm.blocks_held(engine.max_model_len) * block_bytes / 2**20
    return Check("KV pool capacity", "warn", measured, "max_num_seqs x max_model_len fit",
                 f"long sequences will preempt others: the pool holds {tokens} tokens; {max_num_seqs} "
                 f"sequences of {engine.max_model_len} need {want} (--kv-cache-memory {need:.0f}MiB), or lower "
                 f"--max-num-seqs, use a compressed --kv-cache-dtype, or --offload-memory for single long ones "
                 f"(kvserve memory plans it)", correctness=False)


def performance_advice(perf: dict[str, Any]) -> str:
    split = perf["decode"]["split_ms"]
    top = max(split, key=split.get)
    advice = {
        "linears_and_layer_ops": "the step reads the weights: batch more sequences per step (--max-num-seqs) "
                                 "to spend each weight read on more tokens",
        "attention": "attention over the KV pages dominates (long contexts): a compressed --kv-cache-dtype "
                     "reads fewer bytes; check --attention-backend is a fast one (not torch)",
        "sampler": "sampling dominates: penalties, logprobs or top-p over a large vocabulary cost per row",
        "scheduler": "scheduling dominates: a very large batch of short steps; raise --max-num-batched-tokens",
        "python_overhead": "Python bookkeeping dominates a small step: batch more (--max-num-seqs), keep "
                           "--cpu-kernels on"}[top]
    if perf["batching"]["steps_with_a_stalled_stream"] > 0.1:
        advice += "; running streams waited for prefills: keep --enable-chunked-prefill on"
    if perf["huge_pages"]["mode"] == "never":
        advice += ("; transparent huge pages are off (never): the weights and KV pages stream from 4 KiB pages, and "
                   "decode steps ran 15-20% slower so (AMD Zen 4, BENCHMARKS.md): echo madvise | sudo tee "
                   "/sys/kernel/mm/transparent_hugepage/enabled")
    return f"{top} takes the largest share of a decode step: {advice}"


def huge_pages_line(huge: dict[str, Any]) -> str:
    mode = "none on this system" if huge["mode"] is None else f"THP mode {huge['mode']}"
    held = "" if huge["resident_mib"] is None else f"; {huge['resident_mib']:.0f} MiB of this process in them"
    return f"huge pages: {mode}{held}"


def format_report(report: dict[str, Any]) -> str:
    lines = [f"kvserve doctor: {report['model']} ({report['dtype']}, KV {report['kv_cache_dtype']}, "
             f"attention {report['attention_backend']}; text: {report['text']})",
             f"KV cache groups: {report['kv_cache_groups']}", ""]
    for c in report["checks"]:
        measured = ", ".join(f"{k} {v:.4g}" for k, v in c["measured"].items())
        lines.append(f"[{c['status'].upper():4}] {c['name']}: {measured or '-'} (want {c['threshold']})")
        if c["advice"]:
            lines.append(f"       -> {c['advice']}")
    if "performance" in report:
        d = report["performance"]["decode"]
        b = report["performance"]["batching"]
        split = ", ".join(f"{k} {v:.2f}" for k, v in d["split_ms"].items())
        lines += ["", f"decode step of {d['batch']} sequences: {d['step_ms']:.2f} ms ({split} ms)",
                  f"reads {d['bytes_per_step'] / 1e6:.1f} MB per step: {d['bandwidth_pct']:.0f}% of the "
                  f"{d['read_gb_s']:.1f} GB/s measured now; {d['compute_pct']:.1f}% of the matmul peak",
                  huge_pages_line(report["performance"]["huge_pages"]),
                  f"batching: {100 * b['mean_batch_fill']:.0f}% of max_num_seqs filled on average; "
                  f"{100 * b['steps_with_a_stalled_stream']:.0f}% of steps left a running stream without a token",
                  f"-> {report['performance']['advice']}"]
    failed = [c["name"] for c in report["checks"] if c["status"] == "fail" and c["correctness"]]
    lines += ["", f"correctness: {'FAIL (' + ', '.join(failed) + ')' if failed else 'all checks pass'}"]
    return "\n".join(lines)
