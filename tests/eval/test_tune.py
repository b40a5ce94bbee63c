"""`kvserve tune-kv` on a tiny random model: the plan meets its own budget on the calibration
windows (checked independently through `kvserve eval`'s measure), loads as a plan, and bad budgets
name the option."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from kvserve.cache.kv_plan import KVPlan
from kvserve.cli import build_parser
from kvserve.eval import quality
from kvserve.eval.tune import Budget, tune
from kvserve.engine_args import llm_from_args


def tune_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["tune-kv", "--model", "random:tiny", "--dtype", "float32", "--device", "cpu",
                                      "--kv-cache-memory", "8MiB", "--windows", "2", "--window-len", "48",
                                      "--candidates", "int8,int4", "--kv-group-size", "16",
                                      "--plan", str(tmp_path / "plan.json"), *extra])


def tokens(n: int) -> list[int]:
    g = torch.Generator().manual_seed(5)
    return torch.randint(3, 250, (n,), generator=g).tolist()


def measured_kl(args: argparse.Namespace, spec: str) -> float:
    windows = [tokens(96)[i * 48:(i + 1) * 48] for i in range(2)]
    run = [quality.forced_logprobs(llm_from_args(args, kv_cache_dtype=s, enable_prefix_caching=False), windows, 24)
           for s in ("auto", spec)]
    return quality.compare(run[1], run[0], torch.tensor([w[24:] for w in windows])).kl


@pytest.mark.parametrize("max_kl, chosen", [(1e-9, ["auto", None]), (3e-6, ["int8", "int4"]),
                                             (1.0, ["int4", "int4"])])
def test_the_plan_meets_its_budget_on_the_calibration_text(tmp_path: Path, max_kl: float, chosen: list) -> None:
    """On this model and text (seen in the tuner's table): layer 0 loses 1.5e-8 in int8 and 6.4e-6
    in int4, layer 1 nothing measurable in int8 and 1.7e-6 in int4; so 3e-6 affords int4 in layer
    1 only, and 1e-9 no compression of layer 0."""
    args = tune_args(tmp_path, "--max-kl", str(max_kl))
    result = tune(args, Budget(max_kl=max_kl), ["int8", "int4"], tokens(96))
    result.plan.save(args.plan)
    assert KVPlan.load(args.plan) == result.plan and len(result.plan.layers) == 2
    kl = measured_kl(args, f"plan:{args.plan}")
    assert kl == pytest.approx(result.kl, rel=1e-6, abs=1e-12) and kl <= max_kl
    got = [pair[0] for pair in result.plan.layers]
    assert [g if c is not None else None for g, c in zip(got, chosen)] == chosen
    options = {"auto": 128, "int8": 36, "int4": 24}  # bytes per token and KV head (fp32, head_dim 16, g16)
    assert result.bytes_per_token == sum(2 * options[g] for g in got)
    assert "plan written to" in result.report("tokens", args.plan)


def test_a_perplexity_budget_is_met_by_the_plan_run_whole(tmp_path: Path) -> None:
    args = tune_args(tmp_path, "--max-ppl-increase", "0.1%")
    assert args.max_ppl_increase == pytest.approx(0.001)
    result = tune(args, Budget(max_ppl_increase=0.001), ["int8", "int4"], tokens(96))
    result.plan.save(args.plan)
    windows = [tokens(96)[i * 48:(i + 1) * 48] for i in range(2)]
    targets = torch.tensor([w[24:] for w in windows])
    runs = [quality.forced_logprobs(llm_from_args(args, kv_cache_dtype=s, enable_prefix_caching=False), windows, 24)
            for s in ("auto", f"plan:{args.plan}")]
    ppl = [quality.compare(run, run, targets).perplexity for run in runs]
    assert ppl[1] / ppl[0] - 1 <= 0.001 and ppl[1] == pytest.approx(result.ppl)
    assert result.bytes_per_token < result.dense_bytes_per_token  # int8 is near free here: something compressed


def test_a_size_budget_gives_the_least_loss_within_it(tmp_path: Path) -> None:
    args = tune_args(tmp_path)
    # Per token and KV head (fp32, head_dim 16): fp32 128 B, int8 36 B, int4 g16 24 B; 2 heads, 2 layers.
    bound = 2 * (36 + 128)  # room for int8 in one layer with the other full, or int8 / int4 mixes
    result = tune(args, Budget(bytes_per_token=bound), ["int8", "int4"], tokens(96))
    assert result.bytes_per_token <= bound
    options = {"auto": 128, "int8": 36, "int4": 24}
    assert sum(2 * options[pair[0]] for pair in result.plan.layers) == result.bytes_per_token


def test_an_impossible_size_budget_is_refused_before_any_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer in int4 (24 B per token and KV head here) is the floor: 1 byte per token used to
    start the whole sensitivity sweep (~150 runs on the bundled model) before failing."""
    runs = []
    monkeypatch.setattr(quality, "forced_logprobs", lambda *a, **k: runs.append(a))
    with pytest.raises(SystemExit, match=r"--bytes-per-token 1 is below the smallest plan of these candidates \(96 "):
        tune(tune_args(tmp_path), Budget(bytes_per_token=1), ["int8", "int4"], tokens(96))
    assert runs == []


@pytest.mark.parametrize("budget, field", [
    (dict(), "exactly one"),
    (dict(max_kl=0.1, bytes_per_token=100), "--max-kl, --bytes-per-token"),
    (dict(max_kl=-1.0), "--max-kl must be a positive number"),
    (dict(max_ppl_increase=float("nan")), "--max-ppl-increase must be a positive number"),
])
def test_bad_budgets_name_the_option(budget: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Budget(**budget)
