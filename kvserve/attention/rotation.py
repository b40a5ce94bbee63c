"""An orthogonal rotation of every head's query, key and value before the pages (QuaRot's idea
applied to the KV cache): a rotation spreads a few large channels over all of them, so a
quantized page loses less, and changes nothing else.

With R orthogonal (R Rᵀ = I): scores (q R)(k R)ᵀ = q kᵀ, and attention over values v R is the
plain output times R, undone by Rᵀ. So the backends, the pages, swap, offload, the prefix cache
and eviction scores all work on rotated vectors unchanged; only `StepAttention` rotates.
Values alone may be rotated (`keys=False`): per-channel key formats then keep a key outlier in
its own channel, where a few wider channels can hold it (kv_key_wide_channels).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ROTATIONS = ("none", "hadamard", "random")


def rotation_matrix(kind: str, dim: int, seed: int) -> torch.Tensor | None:
    """[dim, dim] fp32 orthogonal, or None for "none". `hadamard`: a Walsh-Hadamard matrix with
    random signs on its rows (QuaRot's randomized Hadamard; dim a power of two); `random`: the Q
    of a Gaussian matrix's QR (any dim)."""
    if kind == "none":
        return None
    g = torch.Generator().manual_seed(seed)
    if kind == "hadamard":
        if dim & (dim - 1):
            raise ValueError(f"EngineConfig.kv_rotation: 'hadamard' needs a power-of-two head_dim, got {dim}; "
                             "use 'random'")
        h = torch.ones(1, 1)
        while h.shape[0] < dim:  # Sylvester's construction
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (dim,), generator=g).float() * 2 - 1
        return signs[:, None] * h / dim ** 0.5
    if kind == "random":
        q, r = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
        return (q * r.diagonal().sign()).float()  # the sign fix makes Q unique (Haar)
    raise ValueError(f"EngineConfig.kv_rotation must be one of {', '.join(ROTATIONS)}, got {kind!r}")


def rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ r in fp32, back in x's dtype (bf16 products would add their rounding twice)."""
    return (x.float() @ r).to(x.dtype)


@dataclass(frozen=True)
class KVRotation:
    """What `StepAttention` rotates: values always, queries and keys unless `keys` is False."""
    matrix: torch.Tensor  # [D, D] orthogonal, fp32
    keys: bool = True

    def to(self, device: torch.device) -> "KVRotation":
        return KVRotation(self.matrix.to(device), self.keys)


def kv_rotation(kind: str, dim: int, seed: int, keys: bool = True) -> KVRotation | None:
    """The engine's rotation for `kv_rotation=kind` and `kv_rotate_keys=keys`; None for "none"."""
    matrix = rotation_matrix(kind, dim, seed)
    return None if matrix is None else KVRotation(matrix, keys)
