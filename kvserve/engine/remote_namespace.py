"""What a remote KV tier's entries are valid for: two engines may share a block only if every
byte of its pages would be the same, so the namespace names the model's weights (a fingerprint,
not a path: two copies of a model share blocks, two fine-tunes do not) and every setting that
shapes the pages."""
from __future__ import annotations

import hashlib

import torch

from kvserve.cache.formats import KVFormat
from kvserve.cache.block_tier import LAYOUT_VERSION
from kvserve.cache.quantized_pool import LayerFormats
from kvserve.config import EngineConfig


def model_fingerprint(model: torch.nn.Module) -> str:
    """A digest of every parameter's name, shape, dtype and first 256 values: cheap at start-up,
    and weights that differ anywhere almost surely differ there too (each tensor is sampled)."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        head = p.detach().flatten()[:256].float().cpu()
        digest.update(f"{name}{tuple(p.shape)}{p.dtype}".encode() + head.numpy().tobytes())
    return digest.hexdigest()[:32]


def _layout(fmt: KVFormat) -> str:
    """A format's name and every option that changes its bytes."""
    options = ("group_size", "exact_sink", "wide", "symmetric")
    return repr(fmt) + "".join(f"/{getattr(fmt, o)}" for o in options if hasattr(fmt, o))


def remote_namespace(model: torch.nn.Module, config: EngineConfig, formats: list[LayerFormats] | None,
                     rank: int = 0, world_size: int = 1) -> str:
    pages = "dense" if formats is None else ";".join(f"{_layout(k)}/{_layout(v)}" for k, v in formats)
    # Per-head fp8 scales, wide key channels, mixed keys' bits per channel and fitted keys' offsets,
    # weights and channel spreads are calibrated, and a vector format's codebook is a shipped file,
    # so blocks encoded with others decode (or encode) otherwise: their values are part of the name.
    tables = ("head_scale", "wide_channels", "channel_bits", "offset", "weight", "spread", "codebook")
    calibrated = [t.float().flatten() for pair in formats or [] for f in pair
                  for t in (getattr(f, name, None) for name in tables) if t is not None]
    if calibrated:
        pages += "@" + hashlib.sha256(torch.cat(calibrated).cpu().numpy().tobytes()).hexdigest()[:16]
    rotation, fmt = "none", config.kv_format
    if fmt.kv_rotation != "none":
        rotation = f"{fmt.kv_rotation}:{config.model.seed}" + ("" if fmt.kv_rotate_keys else ":values")
    return (f"{model_fingerprint(model)}@{config.model.torch_dtype}@bs{config.cache.block_size}@{pages}@rot={rotation}"
            f"@outliers={fmt.kv_outliers}@sparse={fmt.kv_sparse_threshold},{fmt.kv_sparse_capacity}"
            f"@layout{LAYOUT_VERSION}@tp{rank}/{world_size}")
