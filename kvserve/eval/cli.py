"""`kvserve eval`: quality of KV-cache formats against the model-dtype cache, with HF's
QuantizedCache side by side on the same windows."""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvserve.attention.rotation import ROTATIONS
from kvserve.config import DTYPES
from kvserve.eviction.policy import SCORED
from kvserve.engine_args import add_engine_args, kv_format_overrides, llm_from_args
from kvserve.texts import DATA_HELP, load_text

if TYPE_CHECKING:
    from kvserve import LLM

DEFAULT_FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8", "int4", "kivi4", "kivi2", "outlier", "sparse")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("eval", help="perplexity, KL, greedy agreement and passkey per KV-cache format",
                       description="Runs windows of a text (--data) through the engine's real cache path for every "
                                   "format, against the reference cache (the model dtype), and HF "
                                   "transformers' QuantizedCache at the same bits. Writes a table and a "
                                   "plot of quality vs bytes per token.")
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                   help="comma-separated kv_cache_dtype values, each optionally name@residual for its own "
                        f"full-precision window (default: {','.join(DEFAULT_FORMATS)})")
    p.add_argument("--rotations", default=None,
                   help="comma-separated kv_rotation values to run every format with, one row each "
                        f"({', '.join(ROTATIONS)}; default: --kv-rotation alone)")
    p.add_argument("--windows", type=int, default=4, help="text windows (default 4)")
    p.add_argument("--window-len", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--stride", type=int, default=512, help="tokens between window starts (default 512)")
    p.add_argument("--first-window", type=int, default=0,
                   help="windows skipped at the text's start, to measure further windows (default 0)")
    p.add_argument("--greedy-prompts", type=int, default=8, help="prompts for greedy agreement (default 8)")
    p.add_argument("--greedy-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--passkey-lengths", default="256,512,1024",
                   help="context lengths for passkey retrieval (default 256,512,1024)")
    p.add_argument("--passkey-trials", type=int, default=5, help="keys per length (default 5)")
    p.add_argument("--evictions", default="",
                   help="comma-separated kv_eviction policies to add as rows at --kv-budget (window, h2o, snapkv, "
                        "tova, strided); with --no-kv-evict-during-decode each evicts once when the prompt ends")
    p.add_argument("--kvpress", default=None, metavar="PYTHON",
                   help="a python with kvpress 0.5.5 (benchmarks/kvpress_env.sh makes one): adds its presses for "
                        "the --evictions policies it has (window, snapkv, tova, h2o) on the same windows")
    p.add_argument("--hf-bits", default="4,2", help="HF QuantizedCache bits to run (default 4,2; '' skips)")
    p.add_argument("--hf-backend", default="quanto", help="quanto (default) or hqq")
    p.add_argument("--data", default=None, help=DATA_HELP)
    p.add_argument("--out", default="bench_out", help="folder for eval.md, eval.json and eval.png")
    p.add_argument("--seed", type=int, default=0)
    add_engine_args(p)
    p.set_defaults(func=cmd_eval, kv_cache_memory="512MiB", max_model_len=2048)


def _format_label(name: str, rotation: str, args: argparse.Namespace) -> str:
    """A row's name with every layout option that changed it (sinks, wide channels and symmetric
    values are KIVI's alone)."""
    parts = [name]
    if name.startswith("kivi"):
        parts += ["exact sink"] * args.kv_exact_sink
        parts += [f"{args.kv_key_wide_channels} wide key channels"] * bool(args.kv_key_wide_channels)
        parts += ["symmetric values"] * args.kv_symmetric_values
    if rotation != "none":
        parts.append(f"{'' if args.kv_rotate_keys else 'values '}rotated ({rotation})")
    return " ".join(parts)


def cmd_eval(args: argparse.Namespace) -> None:
    from kvserve.eval import quality

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    formats = [f for f in args.formats.split(",") if f]

    def make_llm(spec: str, **overrides: Any) -> LLM:
        """`name` or `name@residual`. No prefix caching: a cached prompt is run in other batch
        shapes than a fresh one, and bf16 rounding alone would then split greedy paths."""
        return llm_from_args(args, max_num_seqs=max(args.max_num_seqs, args.windows, args.greedy_prompts),
                             enable_prefix_caching=False, **kv_format_overrides(spec, args), **overrides)

    rotations = [r for r in args.rotations.split(",") if r] if args.rotations else [args.kv_rotation]
    reference = make_llm("auto", kv_rotation="none")
    tok = reference.tokenizer
    source = load_text(args.data)
    text = source.text
    # Enough text for the windows from the front and the greedy prompts from the back (at least
    # 499 tokens apart each, at no more than 8 characters a token).
    if args.first_window < 0 or args.windows < 1:
        raise ValueError(f"--first-window must be >= 0 and --windows >= 1, got {args.first_window}, {args.windows}")
    starts = [(args.first_window + i) * args.stride for i in range(args.windows)]
    chars = max(40 * (starts[-1] + args.window_len), 8 * 499 * (args.greedy_prompts + 1))
    ids = tok.encode(text[:chars], add_special_tokens=False)
    windows = [ids[start:start + args.window_len] for start in starts]
    if len(windows[-1]) < args.window_len:
        raise ValueError("--windows/--stride: the text is too short for these windows")
    prefill = args.window_len // 2
    targets = torch.tensor([w[prefill:] for w in windows])
    # Prompts longer than the default kivi window, so that greedy runs read quantized pages too.
    greedy_prompts = [ids[-(i + 1) * 499 - 256:-(i + 1) * 499] for i in range(args.greedy_prompts)]
    greedy = quality.SamplingParams(max_tokens=args.greedy_tokens, temperature=0, ignore_eos=True)
    passkeys = {n: quality.passkey_prompts(tok, n, args.passkey_trials, args.seed)
                for n in (int(x) for x in args.passkey_lengths.split(",") if x)}

    ref_logprobs = quality.forced_logprobs(reference, windows, prefill)
    ref_greedy = [o.token_ids for o in reference.generate(greedy_prompts, greedy, use_tqdm=False)]
    model_cfg = reference.engine.model_config

    def measure(llm: LLM, name: str) -> dict[str, Any]:
        q = quality.compare(quality.forced_logprobs(llm, windows, prefill), ref_logprobs, targets)
        outs = [o.token_ids for o in llm.generate(greedy_prompts, greedy, use_tqdm=False)]
        engine = llm.engine
        row = {"cache": f"kvserve {name}", "bytes_per_token": engine.kv_bytes_per_token,
               "capacity_tokens": engine.block_manager.num_blocks * engine.block_manager.block_size,
               "perplexity": q.perplexity, "kl": q.kl, "top1": q.top1,
               "greedy_agree": quality.greedy_agreement(outs, ref_greedy),
               **{f"passkey@{n}": quality.passkey_accuracy(llm, p) for n, p in passkeys.items()}}
        if hasattr(engine.pool, "kept_fraction") and (kept := engine.pool.kept_fraction()):
            row["kept_fraction"] = kept
        print(_format_row(row), flush=True)
        return row

    rows = [measure(reference, f"reference ({args.dtype})")]
    del reference
    for name in formats:
        for rotation in rotations:
            rows.append(measure(make_llm(name, kv_rotation=rotation), _format_label(name, rotation, args)))
    evictions = [e for e in args.evictions.split(",") if e]
    protocol = "during decode" if args.kv_evict_during_decode else "once at the prompt's end"
    for policy in evictions:
        heads = " heads averaged" if args.kv_mean_heads and policy in SCORED else ""
        rows.append(measure(make_llm(args.kv_cache_dtype, kv_eviction=policy),
                            f"evict {policy}{heads} @{args.kv_budget} ({protocol})"))

    notes = []
    if evictions and args.kvpress:
        rows += kvpress_rows(args, windows, prefill, evictions)
    if bits := [int(b) for b in args.hf_bits.split(",") if b]:
        missing = _hf_backend_missing(args.hf_backend)
        if missing is None:
            rows += _hf_rows(args, windows, prefill, bits, model_cfg)
        else:
            notes.append(f"HF QuantizedCache rows skipped: {missing}")
            print(notes[-1], flush=True)
    _report(args, rows, out, prefill, source.name, notes)


def kvpress_rows(args: argparse.Namespace, windows: list[list[int]], prefill: int,
                 policies: list[str]) -> list[dict[str, Any]]:
    """kvpress' matching presses on the same windows, in its own environment (kvpress_runner.py)."""
    import subprocess
    import tempfile

    from kvserve.model.loader import convert_gguf, default_model_path

    source = Path(args.model) if args.model else default_model_path()
    model_dir = convert_gguf(source) if source.suffix == ".gguf" else source
    matched = [p for p in policies if p in ("window", "snapkv", "tova", "h2o")]
    spec = {"model_dir": str(model_dir), "windows": windows, "prefill": prefill, "budget": args.kv_budget,
            "dtype": str(DTYPES[args.dtype]).removeprefix("torch."),
            "policies": matched, "sink_tokens": args.kv_sink_tokens, "observation_window": args.kv_observation_window,
            "pooling_kernel": args.kv_pooling_kernel, "threads": torch.get_num_threads()}
    runner = Path(__file__).with_name("kvpress_runner.py")
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        subprocess.run([args.kvpress, str(runner), str(spec_path), str(out_path)], check=True)
        results = json.loads(out_path.read_text())
    press = {"window": "StreamingLLMPress", "snapkv": "SnapKVPress", "tova": "TOVAPress", "h2o": "ObservedAttentionPress"}
    full = torch.tensor(results["full"]["argmax"])
    rows = []
    for name in ["full", *matched]:
        nll = torch.tensor(results[name]["nll"], dtype=torch.float64)
        rows.append({"cache": f"kvpress {results['version']} " + ("full cache" if name == "full" else
                                                                  f"{press[name]} @{args.kv_budget} (once at the prompt's end)"),
                     "perplexity": nll.mean().exp().item(),
                     "top1_vs_kvpress_full": (torch.tensor(results[name]["argmax"]) == full).double().mean().item()})
        print(_format_row(rows[-1]), flush=True)
    return rows


def _hf_backend_missing(backend: str) -> str | None:
    """Why HF's QuantizedCache cannot run here (its backend is an optional extra), or None."""
    module = {"quanto": "optimum.quanto", "hqq": "hqq"}.get(backend)
    if module is None:
        return f"--hf-backend {backend!r} is not quanto or hqq"
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package (optimum) is absent
        found = False
    package = "optimum-quanto" if backend == "quanto" else "hqq"
    return None if found else f"{module} is not installed (pip install {package})"


def _hf_rows(args: argparse.Namespace, windows: list[list[int]], prefill: int, bits_list: list[int],
             cfg: Any) -> list[dict[str, Any]]:
    """HF's QuantizedCache at each bit width, against HF's own full-precision cache, one model load."""
    from kvserve.bench.hf_baseline import load_hf_model
    from kvserve.eval.hf_quantized import hf_decode_nll, perplexity
    from kvserve.model.loader import default_model_path

    model, _ = load_hf_model(str(args.model or default_model_path()), DTYPES[args.dtype])
    window_tensor = torch.tensor(windows)
    full, full_argmax = hf_decode_nll(model, window_tensor, prefill, "dynamic")
    rows = []
    for bits in bits_list:
        nll, argmax = hf_decode_nll(model, window_tensor, prefill, args.hf_backend, bits, q_group_size=64,
                                    residual_length=128)
        # Codes plus an fp scale and zero-point per 64 channels, for K and V (residual not counted).
        per_head = cfg.head_dim * bits / 8 + cfg.head_dim / 64 * 2 * model.dtype.itemsize
        rows.append({"cache": f"HF QuantizedCache {args.hf_backend} {bits}-bit (g64, residual 128)",
                     "bytes_per_token": 2 * cfg.num_layers * cfg.num_kv_heads * per_head,
                     "perplexity": perplexity(nll), "hf_full_perplexity": perplexity(full),
                     "top1_vs_hf_full": (argmax == full_argmax).double().mean().item()})
        print(_format_row(rows[-1]), flush=True)
    return rows


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):  # not measured (e.g. --greedy-prompts 0)
        return "-"
    if isinstance(value, float) and value >= 100:
        return f"{value:,.0f}"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _format_row(row: dict[str, Any]) -> str:
    return "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def _report(args: argparse.Namespace, rows: list[dict[str, Any]], out: Path, prefill: int, text_name: str,
            notes: list[str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = rows[0]  # the reference cache
    cols = ["bytes_per_token", "perplexity", "kl", "top1", "greedy_agree",
            *[k for k in rows[0] if k.startswith("passkey@")]]
    skipped = f", from window {args.first_window}" if args.first_window else ""
    lines = [f"{text_name}, {args.windows} windows of {args.window_len} tokens (stride {args.stride}{skipped}): "
             f"{prefill} prefilled, {args.window_len - prefill} decoded token by token into the cache; "
             f"perplexity over the decoded targets. Reference cache: the model dtype ({args.dtype}); "
             f"KL(reference || format) and top-1 agreement per decoded position. Greedy: {args.greedy_prompts} "
             f"prompts x {args.greedy_tokens} tokens, mean tokens before the first divergence. Passkey: "
             f"{args.passkey_trials} keys per context length.", "",
             "| cache | " + " | ".join(cols) + " | ppl vs reference |", "|---" * (len(cols) + 2) + "|"]
    for r in rows:
        cells = [_cell(r.get(c)) for c in cols]
        lines.append(f"| {r['cache']} | " + " | ".join(cells) + f" | {100 * (r['perplexity'] / base['perplexity'] - 1):+.2f}% |")
    for r in rows:
        if "top1_vs_kvpress_full" in r:
            lines.append(f"\n{r['cache']}: top-1 agreement with kvpress' full cache {r['top1_vs_kvpress_full']:.3f}")
        if "hf_full_perplexity" in r:
            lines.append(f"\n{r['cache']}: HF full-precision cache perplexity {r['hf_full_perplexity']:.3f} "
                         f"in the same run; top-1 agreement with it {r['top1_vs_hf_full']:.3f}")
        if "kept_fraction" in r:
            lines.append(f"\n{r['cache']}: kept fraction {r['kept_fraction']}")
    lines += [f"\n{note}" for note in notes]
    text = "\n".join(lines)
    print(text)
    (out / "eval.md").write_text(text + "\n")
    (out / "eval.json").write_text(json.dumps(rows, indent=2))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        if "bytes_per_token" not in r:  # kvpress rows: same bytes as the reference, fewer tokens
            continue
        ax.scatter(r["bytes_per_token"], r["perplexity"], marker="s" if r["cache"].startswith("HF") else "o")
        ax.annotate(r["cache"].replace("kvserve ", "").replace("HF QuantizedCache", "HF"),
                    (r["bytes_per_token"], r["perplexity"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("KV bytes per token (all layers, K+V)")
    ax.set_ylabel(f"perplexity (decoded half), {text_name}")
    ax.set_title("KV-cache format: quality vs memory")
    fig.tight_layout()
    fig.savefig(out / "eval.png", dpi=120)
