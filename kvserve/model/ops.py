"""The decoder's small per-layer ops, in two implementations with one interface.

`EagerOps` is plain torch on any device (the reference semantics: RMSNorm statistics in fp32,
RoPE and SiLU in the model dtype). The compiled CPU kernels (`kvserve.kernels.cpu_extension`)
export the same functions, fused: each is one pass over its rows instead of several eager ops,
which is most of a CPU decode step's overhead.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F


class Ops(Protocol):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None) -> torch.Tensor: ...

    def rope_split(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   heads: int, kv_heads: int, head_dim: int) -> list[torch.Tensor]: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def offset_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                        residual: torch.Tensor | None) -> torch.Tensor: ...

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def argmax(self, logits: torch.Tensor) -> torch.Tensor: ...


class EagerOps:
    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None) -> torch.Tensor:
        """With `residual`: residual += x first (in place) and the sum is normalised."""
        if residual is not None:
            x = residual.add_(x)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    @staticmethod
    def rope_split(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   heads: int, kv_heads: int, head_dim: int) -> list[torch.Tensor]:
        """qkv [T, (heads + 2 * kv_heads) * head_dim]: rotate-half RoPE in place on the q and k
        heads (cos/sin: fp32 tables [max_position, head_dim / 2]); returns q, k, v [T, n, D] views."""
        q, k, v = qkv.unflatten(1, (-1, head_dim)).split([heads, kv_heads, kv_heads], dim=1)
        c, s = cos[positions].unsqueeze(1).to(qkv.dtype), sin[positions].unsqueeze(1).to(qkv.dtype)
        for x in (q, k):
            x1, x2 = x.chunk(2, dim=-1)
            x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
        return [q, k, v]

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                        residual: torch.Tensor | None) -> torch.Tensor:
        """Gemma's RMSNorm, as transformers' Gemma3RMSNorm: x scaled by 1 + weight, all in fp32,
        then cast; with `residual`: residual += x first (in place) and the sum is normalised."""
        if residual is not None:
            x = residual.add_(x)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return (x32 * (1.0 + weight.float())).to(x.dtype)

    @staticmethod
    def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU with the tanh GELU (`gelu_pytorch_tanh`, Gemma), in the model dtype as transformers."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    @staticmethod
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        """[B, V] -> [B] int64: each row's first largest value (a NaN counts as the largest)."""
        return logits.argmax(dim=-1)


def resolve_ops(kernels: Any | None) -> Ops:
    return EagerOps() if kernels is None else kernels
