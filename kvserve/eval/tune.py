"""`kvserve tune-kv`: per-layer KV formats chosen by a quality budget, written as a plan file.

1. Sensitivity: on a calibration text, for every layer and candidate format, the KL against the
   model-dtype cache when only that layer's pages use the format, measured through the engine's
   real cache path (teacher-forced windows, as `kvserve eval`). KL, not the perplexity change,
   even for a perplexity budget: one layer's perplexity change is within the noise of a few
   windows (and can be negative), where its KL is positive and steady.
2. Solve (`plan_solver`): the cheapest assignment whose summed per-layer KL is within a limit,
   or the least KL within `--bytes-per-token`.
3. Check: each plan is run whole on the same windows and judged by the budget's own measure
   (KL for `--max-kl`, perplexity for `--max-ppl-increase`); the KL limit is searched (doubled
   while plans pass, then bisected) for the smallest plan that passes, since per-layer losses
   need not add up and KL is only a proxy for perplexity.
The plan loads with `kv_cache_dtype="plan:PATH"`.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from kvserve.arg_types import at_least
from kvserve.cache.formats import format_names
from kvserve.cache.kv_plan import KVPlan
from kvserve.config import EngineConfig
from kvserve.engine_args import add_engine_args, engine_kwargs, llm_from_args
from kvserve.eval import quality
from kvserve.eval.plan_solver import solve
from kvserve.texts import DATA_HELP, load_text

CHECK_ROUNDS = 6


@dataclass(frozen=True)
class Budget:
    """Exactly one bound; errors name the option."""
    max_kl: float | None = None
    max_ppl_increase: float | None = None  # a fraction: 0.01 is 1%
    bytes_per_token: float | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("max_kl", "max_ppl_increase", "bytes_per_token") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("tune-kv: give exactly one of --max-kl, --max-ppl-increase and --bytes-per-token"
                             + (f" (got {', '.join('--' + g.replace('_', '-') for g in given)})" if given else ""))
        value = getattr(self, given[0])
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"tune-kv: --{given[0].replace('_', '-')} must be a positive number, got {value!r}")

    @property
    def on_loss(self) -> bool:
        return self.bytes_per_token is None

    def loss_limit(self) -> float:
        """The bound on the measured loss: KL in nats, or the mean NLL increase log(1 + x)."""
        return self.max_kl if self.max_kl is not None else math.log1p(self.max_ppl_increase)

    def loss(self, q: quality.DecodeQuality, reference_nll: float) -> float:
        """A whole plan's loss as the budget measures it."""
        if self.max_ppl_increase is not None:
            return q.nll.double().mean().item() - reference_nll
        return q.kl


def parse_fraction(text: str) -> float:
    """`1%` or `0.01`."""
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number or a percentage like 1%, got {text!r}") from None


def add_parser(sub: Any) -> None:
    p = sub.add_parser("tune-kv", help="choose each layer's KV format within a quality budget; writes a plan file",
                       description="Measures, on a calibration text, how much each layer's pages lose in each "
                                   "candidate format (only that layer compressed), picks the cheapest per-layer "
                                   "assignment that meets the budget, checks it on the same text, and writes a "
                                   "plan that --kv-cache-dtype plan:PATH loads.")
    bound = p.add_argument_group("budget (exactly one)")
    bound.add_argument("--max-kl", type=float, default=None, help="mean KL against the model-dtype cache, nats")
    bound.add_argument("--max-ppl-increase", type=parse_fraction, default=None,
                       help="perplexity increase, as 1%% or 0.01")
    bound.add_argument("--bytes-per-token", type=float, default=None,
                       help="KV bytes per token (all layers): the least loss within it")
    candidates = ",".join(format_names(default_in="tune"))  # the registry's, as they are when the parser is built
    p.add_argument("--candidates", default=candidates,
                   help=f"formats a layer may take besides the model dtype (default {candidates})")
    p.add_argument("--windows", type=at_least(1), default=4, help="calibration windows (default 4)")
    p.add_argument("--window-len", type=at_least(2), default=512,
                   help="tokens per window, half prefilled (default 512)")
    p.add_argument("--data", default=None, help=DATA_HELP)
    p.add_argument("--plan", default="kv_plan.json", help="where to write the plan (default kv_plan.json)")
    add_engine_args(p)
    # Every probe builds an engine: a pool sized for the windows, not the engine's 2GiB default.
    p.set_defaults(func=cmd_tune_kv, kv_residual=0, kv_cache_memory="256MiB")


def cmd_tune_kv(args: argparse.Namespace) -> None:
    budget = Budget(args.max_kl, args.max_ppl_increase, args.bytes_per_token)
    candidates = [c for c in args.candidates.split(",") if c]
    if not candidates or args.windows < 1 or args.window_len < 4:
        raise SystemExit("tune-kv: --candidates must name a format; --windows >= 1 and --window-len >= 4")
    source = load_text(args.data)
    result = tune(args, budget, candidates, source.text)
    result.plan.save(args.plan)
    print(result.report(source.name, args.plan))


@dataclass
class TuneResult:
    plan: KVPlan
    names: list[str]          # "auto" then the candidates: the columns of `size` and `loss`
    size: np.ndarray          # [L, F] bytes per block of each layer in each format
    loss: np.ndarray          # [L, F] KL with only that layer in that format
    measured: float           # the plan's loss as the budget measures it, run whole on the calibration windows
    kl: float
    ppl: float
    reference_ppl: float
    bytes_per_token: float
    dense_bytes_per_token: float
    budget: Budget

    def report(self, text: str, path: str) -> str:
        counts = {n: sum(pair[0] == n for pair in self.plan.layers) for n in self.names}
        limit = (f"loss {self.measured:.4g} (budget {self.budget.loss_limit():.4g})" if self.budget.on_loss
                 else f"{self.bytes_per_token:,.0f} bytes per token (budget {self.budget.bytes_per_token:,.0f})")
        lines = [f"kvserve tune-kv on {text}: plan written to {path}",
                 "  layers per format: " + ", ".join(f"{n} {c}" for n, c in counts.items() if c),
                 f"  checked on the calibration windows: KL {self.kl:.4g}, perplexity {self.ppl:.4g} vs "
                 f"{self.reference_ppl:.4g} ({100 * (self.ppl / self.reference_ppl - 1):+.2f}%), {limit}",
                 f"  KV bytes per token {self.bytes_per_token:,.0f} "
                 f"({self.bytes_per_token / self.dense_bytes_per_token:.1%} "
                 f"of the model dtype's {self.dense_bytes_per_token:,.0f})",
                 "  layer | " + " | ".join(self.names)]
        for layer, pair in enumerate(self.plan.layers):
            cells = [f"{self.loss[layer, f]:.2e}" + ("*" if n == pair[0] else " ") for f, n in enumerate(self.names)]
            lines.append(f"  {layer:>5} | " + " | ".join(cells))
        lines.append("  (* the plan's choice; each cell the KL with only that layer in that format)")
        return "\n".join(lines)


@torch.inference_mode()
def tune(args: argparse.Namespace, budget: Budget, candidates: list[str], text: str | list[int]) -> TuneResult:
    """`text` is the calibration text, or its token ids (a model without a tokenizer)."""
    probe = dict(enable_prefix_caching=False, max_num_seqs=max(args.max_num_seqs, args.windows))
    reference = llm_from_args(args, kv_cache_dtype="auto", **probe)
    if isinstance(text, str):
        if reference.tokenizer is None:
            raise SystemExit("tune-kv: this model has no tokenizer to read the calibration text with")
        ids = reference.tokenizer.encode(text[:40 * args.window_len * args.windows], add_special_tokens=False)
    else:
        ids = text
    windows = [ids[i * args.window_len:(i + 1) * args.window_len] for i in range(args.windows)]
    if len(windows[-1]) < args.window_len:
        raise SystemExit("tune-kv: the text is too short for --windows x --window-len")
    cfg = reference.engine.model_config
    names = ["auto", *candidates]
    layers = cfg.num_layers
    size = np.zeros((layers, len(names)), dtype=np.int64)
    for f, name in enumerate(names):
        sizes = EngineConfig.of(**engine_kwargs(args, kv_cache_dtype=name, **probe)).kv_sizes(cfg)
        size[:, f] = round(sizes.block_bytes / layers)  # a uniform format: every layer the same share
    # Known before any run: a size budget below every layer's cheapest format has no plan.
    smallest = size.min(axis=1).sum() / args.block_size
    if not budget.on_loss and budget.bytes_per_token < smallest:
        raise SystemExit(f"tune-kv: --bytes-per-token {budget.bytes_per_token:g} is below the smallest plan of "
                         f"these candidates ({smallest:,.0f} bytes per token, every layer in its cheapest of "
                         f"{', '.join(names)}): raise it or add cheaper --candidates")
    prefill = args.window_len // 2
    targets = torch.tensor([w[prefill:] for w in windows])
    ref = quality.forced_logprobs(reference, windows, prefill)
    ref_q = quality.compare(ref, ref, targets)
    ref_nll = ref_q.nll.double().mean().item()
    dense_bytes = reference.engine.kv_bytes_per_token
    del reference
    plan_dir = Path(args.plan).resolve().parent
    scratch = plan_dir / f".{Path(args.plan).name}.probe.json"

    def run(pairs: list[tuple[str, str]]) -> tuple[quality.DecodeQuality, float]:
        """The windows through an engine whose layers use `pairs`: (quality, KV bytes per token)."""
        KVPlan(tuple(pairs)).save(scratch)
        llm = llm_from_args(args, kv_cache_dtype=f"plan:{scratch}", **probe)
        compared = quality.compare(quality.forced_logprobs(llm, windows, prefill), ref, targets)
        return compared, llm.engine.kv_bytes_per_token

    loss = np.zeros((layers, len(names)))
    try:
        with tqdm(total=layers * len(candidates), desc="tune-kv: layer x format", unit="run") as bar:
            for layer in range(layers):
                for f, name in enumerate(names[1:], start=1):
                    pairs = [("auto", "auto")] * layers
                    pairs[layer] = (name, name)
                    loss[layer, f] = max(run(pairs)[0].kl, 0.0)  # rounding can leave a hair below zero
                    bar.update()

        def check(picks: list[int]) -> tuple[list[tuple[str, str]], quality.DecodeQuality, float]:
            """A plan run whole: (its pairs, its quality, its KV bytes per token)."""
            pairs = [(names[f], names[f]) for f in picks]
            return pairs, *run(pairs)

        if not budget.on_loss:
            pairs, q, plan_bytes = check(solve(size, loss, max_size=int(budget.bytes_per_token * args.block_size)))
        else:
            pairs, q, plan_bytes = search(size, loss, budget, ref_nll, check)
    finally:
        scratch.unlink(missing_ok=True)
    measured = budget.loss(q, ref_nll)
    note = (f"kvserve tune-kv: {', '.join(f'{k}={v}' for k, v in vars(budget).items() if v is not None)}, "
            f"{args.windows} x {args.window_len} calibration tokens, model dtype {args.dtype}")
    return TuneResult(KVPlan(tuple(pairs), note), names, size, loss, measured, q.kl, q.perplexity,
                      ref_q.perplexity, plan_bytes, dense_bytes, budget)


def search(size: np.ndarray, loss: np.ndarray, budget: Budget, ref_nll: float,
           check: Any) -> tuple[list[tuple[str, str]], quality.DecodeQuality, float]:
    """The smallest plan that passes `budget` when run whole, over KL limits: doubled from the
    budget's own value while plans pass, bisected (geometrically) once one fails."""
    target = budget.loss_limit()
    limit, passed, failed = target, 0.0, math.inf
    best, tried = None, {}
    for _ in range(CHECK_ROUNDS):
        picks = tuple(solve(size, loss, max_loss=limit))
        if picks not in tried:
            tried[picks] = check(list(picks))
        q = tried[picks][1]
        if budget.loss(q, ref_nll) <= target:
            passed = limit
            if best is None or tried[picks][2] < best[2]:
                best = tried[picks]
        else:
            failed = limit
        limit = limit * 2 if math.isinf(failed) else (math.sqrt(passed * failed) if passed else failed / 4)
    if best is None:
        # A layer whose loss measured 0 alone can still cost a hair run whole (a batch's matmuls
        # round differently on some BLAS builds), so the shrinking limits keep picking it; the
        # uncompressed plan loses nothing by construction.
        picks = (0,) * size.shape[0]
        tried[picks] = tried.get(picks) or check(list(picks))
        q = tried[picks][1]
        if budget.loss(q, ref_nll) > target:
            raise SystemExit(f"tune-kv: no plan met the budget on the calibration text in {CHECK_ROUNDS} rounds "
                             f"(the last lost {budget.loss(q, ref_nll):.4g} > {target:.4g}); loosen it")
        best = tried[picks]
    return best
