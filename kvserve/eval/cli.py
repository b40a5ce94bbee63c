"""`kvserve eval`: quality of KV-cache formats against the model-dtype cache, with HF's
QuantizedCache side by side on the same windows."""
from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvserve.arg_types import at_least, comma_list, folder, one_of
from kvserve.attention.rotation import ROTATIONS
from kvserve.cache.formats import FORMAT_CHOICES, format_names, make_format
from kvserve.cache.kv_plan import plan_path
from kvserve.config import DTYPES, EngineConfig
from kvserve.eviction.policy import POLICY_NAMES, SCORED
from kvserve.engine_args import add_engine_args, engine_kwargs, kv_format_overrides
from kvserve.eval.report import format_row, write_report
from kvserve.texts import DATA_HELP, Text, load_text, shared_passage

EVICTION_ROWS = tuple(p for p in POLICY_NAMES if p != "none")  # "none" would repeat the format's own row
# The module HF's QuantizedCache needs per backend, and the bits each quantizes to (transformers'
# QuantoQuantizedLayer and HQQQuantizedLayer refuse others).
HF_BACKENDS = {"quanto": ("optimum.quanto", (2, 4)), "hqq": ("hqq", (1, 2, 3, 4, 8))}
GREEDY_PROMPT_LEN = 256  # longer than the default kivi window, so that greedy runs read quantized pages too
GREEDY_PROMPT_GAP = 499  # tokens between greedy prompt starts, counted from the text's end
# A row: its label, and the engine options that make it.
Row = tuple[str, dict[str, Any]]


def _format_spec(text: str) -> str:
    """A format as kv_format_overrides reads it: `name` or `name@residual`."""
    name, at, residual = text.partition("@")
    if name != "auto" and name not in FORMAT_CHOICES and plan_path(name) is None:
        raise argparse.ArgumentTypeError(f"{name!r} is not auto, plan:PATH or one of {', '.join(FORMAT_CHOICES)}")
    if at and not residual.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: the residual after @ must be a whole number >= 0")
    return text


def _executable(text: str) -> str:
    """An argparse type: a program that exists (a path, or a name on PATH); else the kvpress rows
    would fail only after every other row has run."""
    if shutil.which(text) is None:
        raise argparse.ArgumentTypeError(f"no executable {text!r}")
    return text


def add_parser(sub: Any) -> None:
    p = sub.add_parser("eval", help="perplexity, KL, greedy agreement and passkey per KV-cache format",
                       description="Runs windows of a text (--data) through the engine's real cache path for every "
                                   "format, against the reference cache (the model dtype), and HF "
                                   "transformers' QuantizedCache at the same bits. Writes a table and a "
                                   "plot of quality vs bytes per token.")
    defaults = ",".join(format_names(default_in="eval"))  # the registry's, as they are when the parser is built
    p.add_argument("--formats", type=comma_list(_format_spec), default=defaults,
                   help="comma-separated kv_cache_dtype values, each optionally name@residual for its own "
                        f"full-precision window (default: {defaults})")
    p.add_argument("--rotations", type=comma_list(one_of(ROTATIONS)), default=None,
                   help="comma-separated kv_rotation values to run every format with, one row each "
                        f"({', '.join(ROTATIONS)}; default: --kv-rotation alone)")
    p.add_argument("--windows", type=at_least(1), default=4, help="text windows (default 4)")
    p.add_argument("--window-len", type=at_least(2), default=512,
                   help="tokens per window, its first half prefilled and its second decoded (default 512)")
    p.add_argument("--stride", type=at_least(1), default=512, help="tokens between window starts (default 512)")
    p.add_argument("--first-window", type=at_least(0), default=0,
                   help="windows skipped at the text's start, to measure further windows (default 0)")
    p.add_argument("--greedy-prompts", type=at_least(0), default=8,
                   help="prompts for greedy agreement (default 8; 0 skips it)")
    p.add_argument("--greedy-tokens", type=at_least(1), default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--passkey-lengths", type=comma_list(at_least(1)), default="256,512,1024",
                   help="context lengths for passkey retrieval (default 256,512,1024; '' skips it)")
    p.add_argument("--passkey-trials", type=at_least(1), default=5, help="keys per length (default 5)")
    p.add_argument("--evictions", type=comma_list(one_of(EVICTION_ROWS)), default="",
                   help="comma-separated kv_eviction policies to add as rows at --kv-budget (window, h2o, snapkv, "
                        "tova, strided); with --no-kv-evict-during-decode each evicts once when the prompt ends")
    p.add_argument("--kvpress", type=_executable, default=None, metavar="PYTHON",
                   help="a python with kvpress 0.5.5 (benchmarks/kvpress_env.sh makes one): adds its presses for "
                        "the --evictions policies it has (window, snapkv, tova, h2o) on the same windows")
    p.add_argument("--hf-bits", type=comma_list(at_least(1)), default="4,2",
                   help="HF QuantizedCache bits to run: 2 or 4 with quanto, 1, 2, 3, 4 or 8 with hqq "
                        "(default 4,2; '' skips)")
    p.add_argument("--hf-backend", choices=sorted(HF_BACKENDS), default="quanto", help="quanto (default) or hqq")
    p.add_argument("--data", type=comma_list(str), default=None,
                   help="comma-separated texts, each measured on the same rows, with a table per text and the "
                        "worst case over them; each is " + DATA_HELP)
    p.add_argument("--out", type=folder, default="bench_out", help="folder for eval.md, eval.json and eval.png")
    p.add_argument("--seed", type=int, default=0, help="seed of the passkeys and of where each is hidden (default 0)")
    add_engine_args(p)
    p.set_defaults(func=partial(cmd_eval, parser=p), kv_cache_memory="512MiB", max_model_len=2048)


def _format_label(name: str, rotation: str, args: argparse.Namespace) -> str:
    """A row's name with every layout option that changed its pages (sinks, wide channels and
    symmetric values, as its formats' layouts show them; `name` may carry @residual)."""
    parts = [name]
    base = name.partition("@")[0]
    if base in FORMAT_CHOICES:
        keys = make_format(base, "k", exact_sink=args.kv_exact_sink, key_wide_channels=args.kv_key_wide_channels)
        values = make_format(base, "v", symmetric_values=args.kv_symmetric_values)
        parts += ["exact sink"] * keys.layout.exact_sink
        parts += [f"{keys.layout.wide} wide key channels"] * bool(keys.layout.wide)
        parts += ["symmetric values"] * values.layout.symmetric
    if rotation != "none":
        parts.append(f"{'' if args.kv_rotate_keys else 'values '}rotated ({rotation})")
    return " ".join(parts)


def _engine_options(args: argparse.Namespace, origin: str, spec: str, **overrides: Any) -> dict[str, Any]:
    """A row's engine options, `spec` being `name` or `name@residual`. No prefix caching: a cached
    prompt is run in other batch shapes than a fresh one, and bf16 rounding alone would then split
    greedy paths. Checked as an EngineConfig here, so that a combination the engine refuses fails
    before the first model loads, named by the option (`origin`) that asked for the row."""
    options = engine_kwargs(args, max_num_seqs=max(args.max_num_seqs, args.windows, args.greedy_prompts),
                            enable_prefix_caching=False, **kv_format_overrides(spec, args), **overrides)
    try:
        EngineConfig.of(**options)
    except ValueError as err:
        raise ValueError(f"{origin}: {err}") from None
    return options


def _rows(args: argparse.Namespace) -> list[Row]:
    """Every row the engine runs: the reference cache (the model dtype), each format with each
    rotation, each eviction policy."""
    rows = [(f"reference ({args.dtype})", _engine_options(args, "the engine options", "auto", kv_rotation="none"))]
    for name in args.formats:
        for rotation in args.rotations or [args.kv_rotation]:
            rows.append((_format_label(name, rotation, args),
                         _engine_options(args, f"--formats {name} (rotation {rotation})", name, kv_rotation=rotation)))
    protocol = "during decode" if args.kv_evict_during_decode else "once at the prompt's end"
    for policy in args.evictions:
        heads = " heads averaged" if args.kv_mean_heads and policy in SCORED else ""
        rows.append((f"evict {policy}{heads} @{args.kv_budget} ({protocol})",
                     _engine_options(args, f"--evictions {policy}", args.kv_cache_dtype, kv_eviction=policy)))
    return rows


def _check_together(args: argparse.Namespace) -> None:
    """What must fit in --max-model-len, and the HF bits against their backend: the engine and HF
    would refuse them only once a run reaches them, after the slow ones before it."""
    from kvserve.eval.quality import PASSKEY_ANSWER_TOKENS

    limit = args.max_model_len
    if args.window_len > limit:
        raise ValueError(f"--window-len {args.window_len} exceeds --max-model-len {limit}")
    if args.greedy_prompts and GREEDY_PROMPT_LEN + args.greedy_tokens > limit:
        raise ValueError(f"--greedy-tokens {args.greedy_tokens} after {GREEDY_PROMPT_LEN}-token prompts exceed "
                         f"--max-model-len {limit}")
    if too_long := [n for n in args.passkey_lengths if n + PASSKEY_ANSWER_TOKENS > limit]:
        raise ValueError(f"--passkey-lengths {too_long}: with the {PASSKEY_ANSWER_TOKENS} tokens of the answer, "
                         f"more than --max-model-len {limit}")
    _, bits = HF_BACKENDS[args.hf_backend]
    if wrong := [b for b in args.hf_bits if b not in bits]:
        raise ValueError(f"--hf-bits {wrong}: the {args.hf_backend} backend quantizes to one of "
                         f"{', '.join(map(str, bits))} bits")


def _check_apart(args: argparse.Namespace, rows: list[Row], sources: list[Text]) -> None:
    """Calibrated layouts (per-head fp8 scales, wide key channels) must not be judged on the text
    they were calibrated on: where a row's formats are calibrated, any passage an evaluated text
    shares with the calibration text is a usage error."""
    from kvserve.engine.kv_calibration import needs_calibration

    if not any(needs_calibration(EngineConfig.of(**options).kv_formats()) for _, options in rows):
        return
    calibration = load_text(args.kv_calibration_data, option="--kv-calibration-data")
    for source in sources:
        if (passage := shared_passage(source.text, calibration.text)) is not None:
            raise ValueError(f"--data: {source.name} shares text with the calibration text ({calibration.name}, "
                             f"--kv-calibration-data), e.g. {passage!r}; calibrated layouts would be judged on "
                             f"what they were fitted to: evaluate on another text or calibrate on another")


@dataclass(frozen=True)
class TextWindows:
    """What every row runs on one text: the windows (teacher-forced from `prefill`) and the
    greedy prompts."""
    name: str
    windows: list[list[int]]
    prefill: int
    greedy_prompts: list[list[int]]

    @property
    def targets(self) -> torch.Tensor:
        return torch.tensor([w[self.prefill:] for w in self.windows])


def _text_windows(args: argparse.Namespace, tok: Any, source: Text) -> TextWindows:
    # Enough text for the windows from the front and the greedy prompts from the back (at least
    # GREEDY_PROMPT_GAP tokens apart each, at no more than 8 characters a token).
    starts = [(args.first_window + i) * args.stride for i in range(args.windows)]
    chars = max(40 * (starts[-1] + args.window_len), 8 * GREEDY_PROMPT_GAP * (args.greedy_prompts + 1))
    ids = tok.encode(source.text[:chars], add_special_tokens=False)
    windows = [ids[start:start + args.window_len] for start in starts]
    if len(windows[-1]) < args.window_len:
        raise ValueError(f"--windows/--stride: {source.name} is too short for these windows")
    greedy_prompts = [ids[-(i + 1) * GREEDY_PROMPT_GAP - GREEDY_PROMPT_LEN:-(i + 1) * GREEDY_PROMPT_GAP]
                      for i in range(args.greedy_prompts)]
    return TextWindows(source.name, windows, args.window_len // 2, greedy_prompts)


def cmd_eval(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from kvserve import LLM
    from kvserve.eval import quality

    try:  # options valid alone but not together are usage errors too, refused before any model loads
        _check_together(args)
        rows = _rows(args)
        (reference_label, reference_options), *others = rows
        sources = [load_text(spec) for spec in args.data or [None]]
        if len({s.name for s in sources}) < len(sources):
            raise ValueError("--data: a text is named twice")
        _check_apart(args, rows, sources)
    except ValueError as err:
        parser.error(str(err))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reference = LLM(**reference_options)
    tok = reference.tokenizer
    if tok is None:  # random:<preset> weights come without one
        raise ValueError("--model: this model has no tokenizer, and eval reads text")
    texts = [_text_windows(args, tok, source) for source in sources]
    greedy = quality.SamplingParams(max_tokens=args.greedy_tokens, temperature=0, ignore_eos=True)
    passkeys = {n: quality.passkey_prompts(tok, n, args.passkey_trials, args.seed) for n in args.passkey_lengths}
    ref_logprobs = [quality.forced_logprobs(reference, t.windows, t.prefill) for t in texts]
    ref_greedy = [[o.token_ids for o in reference.generate(t.greedy_prompts, greedy, use_tqdm=False)] for t in texts]
    model_cfg = reference.engine.model_config

    def measure(llm: LLM, name: str) -> list[dict[str, Any]]:
        """One row per text; the passkeys (text-independent) measured once and shown in each."""
        engine = llm.engine
        common = {"cache": f"kvserve {name}", "bytes_per_token": engine.kv_bytes_per_token,
                  "capacity_tokens": engine.block_manager.num_blocks * engine.block_manager.block_size}
        passkey = {f"passkey@{n}": quality.passkey_accuracy(llm, p) for n, p in passkeys.items()}
        rows = []
        for t, ref, ref_out in zip(texts, ref_logprobs, ref_greedy):
            q = quality.compare(quality.forced_logprobs(llm, t.windows, t.prefill), ref, t.targets)
            outs = [o.token_ids for o in llm.generate(t.greedy_prompts, greedy, use_tqdm=False)]
            row = {**common, "perplexity": q.perplexity, "kl": q.kl, "top1": q.top1,
                   "greedy_agree": quality.greedy_agreement(outs, ref_out), **passkey,
                   "window_perplexity": q.nll.mean(1).exp().tolist()}
            if hasattr(engine.pool, "kept_fraction") and (kept := engine.pool.kept_fraction()):
                row["kept_fraction"] = kept
            print(f"[{t.name}] {format_row(row)}", flush=True)
            rows.append(row)
        return rows

    measured = [measure(reference, reference_label)]
    del reference
    measured += [measure(LLM(**options), label) for label, options in others]
    by_text = {t.name: [rows[i] for rows in measured] for i, t in enumerate(texts)}

    notes = []
    missing = _hf_backend_missing(args.hf_backend) if args.hf_bits else None
    if missing is not None:
        notes.append(f"HF QuantizedCache rows skipped: {missing}")
        print(notes[-1], flush=True)
    for t in texts:
        if args.evictions and args.kvpress:
            by_text[t.name] += kvpress_rows(args, t.windows, t.prefill, args.evictions)
        if args.hf_bits and missing is None:
            by_text[t.name] += _hf_rows(args, t.windows, t.prefill, args.hf_bits, model_cfg)
    first = texts[0]
    skipped = f", from window {args.first_window}" if args.first_window else ""
    protocol = (f"{args.windows} windows of {args.window_len} tokens per text (stride {args.stride}{skipped}): "
                f"{first.prefill} prefilled, {args.window_len - first.prefill} decoded token by token into the "
                f"cache; perplexity over the decoded targets. Reference cache: the model dtype ({args.dtype}); "
                f"KL(reference || format) and top-1 agreement per decoded position. Greedy: {args.greedy_prompts} "
                f"prompts x {args.greedy_tokens} tokens, mean tokens before the first divergence. Passkey: "
                f"{args.passkey_trials} keys per context length. Calibrated layouts read "
                f"{args.kv_calibration_tokens} tokens of {args.kv_calibration_data}.")
    print(write_report(by_text, protocol, out, notes))


def kvpress_rows(args: argparse.Namespace, windows: list[list[int]], prefill: int,
                 policies: list[str]) -> list[dict[str, Any]]:
    """kvpress' matching presses on the same windows, in its own environment (kvpress_runner.py)."""
    import subprocess
    import tempfile

    from kvserve.model.gguf_convert import convert_gguf
    from kvserve.model.loader import model_path

    source = model_path(args.model)
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
    press = {"window": "StreamingLLMPress", "snapkv": "SnapKVPress", "tova": "TOVAPress",
             "h2o": "ObservedAttentionPress"}
    full = torch.tensor(results["full"]["argmax"])
    rows = []
    for name in ["full", *matched]:
        nll = torch.tensor(results[name]["nll"], dtype=torch.float64)
        cache = "full cache" if name == "full" else f"{press[name]} @{args.kv_budget} (once at the prompt's end)"
        rows.append({"cache": f"kvpress {results['version']} {cache}",
                     "perplexity": nll.mean().exp().item(),
                     "top1_vs_kvpress_full": (torch.tensor(results[name]["argmax"]) == full).double().mean().item()})
        print(format_row(rows[-1]), flush=True)
    return rows


def _hf_backend_missing(backend: str) -> str | None:
    """Why HF's QuantizedCache cannot run here (its backend is an optional extra), or None."""
    module, _ = HF_BACKENDS[backend]
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
    from kvserve.model.loader import model_path

    model, _ = load_hf_model(str(model_path(args.model)), DTYPES[args.dtype])
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
        print(format_row(rows[-1]), flush=True)
    return rows
