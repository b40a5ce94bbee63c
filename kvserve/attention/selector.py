"""`attention_backend`: a name, or "auto" for the fastest backend that serves the configuration."""
from __future__ import annotations

import logging

import torch

from kvserve.attention.backend import AttentionBackend, Pool
from kvserve.attention.cpu_paged import CPUPagedBackend
from kvserve.attention.torch_sdpa import TorchSDPABackend
from kvserve.attention.triton_paged import TritonPagedBackend

logger = logging.getLogger(__name__)

BACKENDS: dict[str, type[AttentionBackend]] = {
    b.name: b for b in (CPUPagedBackend, TritonPagedBackend, TorchSDPABackend)}
BACKEND_NAMES = ("auto", *BACKENDS)
# What "auto" tries, fastest first, per device type. The Triton interpreter runs on the CPU but
# only for tests: it is never picked there automatically.
AUTO_ORDER: dict[str, tuple[str, ...]] = {"cpu": ("cpu", "torch"), "cuda": ("triton", "torch")}


def _unsupported(cls: type[AttentionBackend], pool: Pool, device: torch.device, windowed: bool,
                 softcap: float | None) -> str | None:
    if windowed and not cls.masks_window:
        return "no sliding-window mask, and the model has sliding-window layers"
    if softcap is not None and not cls.caps_logits:
        return "no attention logit soft-capping, and the model caps its attention logits (Gemma 2)"
    return cls.unsupported(pool, device)


def make_backend(name: str, pool: Pool, num_heads: int, device: torch.device,
                 windowed: bool = False, softcap: float | None = None) -> AttentionBackend:
    """`windowed`: the model has sliding-window layers (`ModelConfig.sliding_layers`), which only
    backends with `masks_window` serve; `softcap`: the model's `attn_logit_softcapping`, which
    only backends with `caps_logits` serve."""
    if name == "auto":
        reasons = {}
        for cls in (BACKENDS[n] for n in AUTO_ORDER.get(device.type, ("torch",))):
            reason = _unsupported(cls, pool, device, windowed, softcap)
            if reason is None:
                logger.info("attention backend: %s (auto; %s)", cls.name,
                            "; ".join(f"{n}: {r}" for n, r in reasons.items()) or "first choice")
                return cls(pool, num_heads, softcap)
            reasons[cls.name] = reason
        raise AssertionError("the torch backend supports every configuration")
    cls = BACKENDS[name]
    reason = _unsupported(cls, pool, device, windowed, softcap)
    if reason is not None:
        raise ValueError(f"EngineConfig.attention_backend: {name!r} cannot serve this configuration: {reason}")
    logger.info("attention backend: %s", name)
    return cls(pool, num_heads, softcap)
