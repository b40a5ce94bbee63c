"""`attention_backend`: a name, or "auto" for the fastest backend that serves the configuration."""
from __future__ import annotations

import logging

import torch

from kvserve.attention.backend import AttentionBackend, Pool
from kvserve.attention.cpu_paged import CPUPagedBackend
from kvserve.attention.torch_sdpa import TorchSDPABackend

logger = logging.getLogger(__name__)

# Fastest first: "auto" takes the first that supports the configuration.
BACKENDS: dict[str, type[AttentionBackend]] = {b.name: b for b in (CPUPagedBackend, TorchSDPABackend)}
BACKEND_NAMES = ("auto", *BACKENDS)


def make_backend(name: str, pool: Pool, num_heads: int, device: torch.device) -> AttentionBackend:
    if name == "auto":
        reasons = {}
        for cls in BACKENDS.values():
            reason = cls.unsupported(pool, device)
            if reason is None:
                logger.info("attention backend: %s (auto; %s)", cls.name,
                            "; ".join(f"{n}: {r}" for n, r in reasons.items()) or "first choice")
                return cls(pool, num_heads)
            reasons[cls.name] = reason
        raise AssertionError("the torch backend supports every configuration")
    cls = BACKENDS[name]
    reason = cls.unsupported(pool, device)
    if reason is not None:
        raise ValueError(f"EngineConfig.attention_backend: {name!r} cannot serve this configuration: {reason}")
    logger.info("attention backend: %s", name)
    return cls(pool, num_heads)
