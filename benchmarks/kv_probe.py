"""What the offline KV probes (kv_head_loss.py, kv_model_loss.py) share: their common options, the
probe engine, and each format calibrated per layer as the engine would calibrate it."""
from __future__ import annotations

import argparse

import torch

from kvserve.cache.formats import FORMAT_CHOICES, make_format
from kvserve.cache.quantized_pool import LayerFormats
from kvserve.engine.kv_calibration import KVStats, calibrate_formats, calibration_tokens, measure_kv_stats
from kvserve.engine.llm import LLM


def probe_parser(description: str | None, formats: str, formats_help: str) -> argparse.ArgumentParser:
    """A parser with --model, --data, --formats (default `formats`) and --calibration-data."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="kvserve's --model (default: the engine's default model)")
    p.add_argument("--data", default="python-docs", help="the text (kvserve eval's --data)")
    p.add_argument("--formats", default=formats, help=formats_help)
    p.add_argument("--calibration-data", default="calibration", help="kv_calibration_data of calibrated formats")
    return p


def format_names(formats: str) -> list[str]:
    """--formats as names, refused naming the flag if one is unknown."""
    names = formats.split(",")
    if unknown := [n for n in names if n not in FORMAT_CHOICES]:
        raise SystemExit(f"--formats: unknown {', '.join(unknown)}")
    return names


def probe_llm(model: str | None, **options: object) -> LLM:
    # The fused C++ ops are left out: these are offline probes, their speed buys nothing here.
    return LLM(model, kv_cache_dtype="auto", cpu_kernels=False, enable_prefix_caching=False,
               kv_cache_memory="64MiB", **options)


def kv_stats(llm: LLM, calibration_data: str) -> KVStats:
    """The engine's start-up calibration statistics, on 512 tokens of `calibration_data`."""
    model = llm.engine.model
    tokens = calibration_tokens(llm.tokenizer, model.config.vocab_size, 512, 0, calibration_data)
    return measure_kv_stats(model, llm.engine.runner.ops, tokens, None, next(model.parameters()).dtype,
                            torch.device("cpu"))


def calibrated_layers(name: str, layers: int, stats: KVStats) -> list[LayerFormats]:
    """Format `name`'s keys and values for each of `layers` layers, calibrated on that layer."""
    return calibrate_formats([(make_format(name, "k"), make_format(name, "v"))] * layers, stats)
