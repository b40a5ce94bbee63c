"""RoPE undone within a block: each key turned back by its offset in the block (`BlockRope`), so a
block's keys are stored as if every one of them sat at the block's first position.

Why: a per-channel code spans the block's range of each channel (KIVI keys). After RoPE a fast
pair of channels turns through many angles within a block, so each of its two channels swings over
+-|pair| whatever the key says, and the codes spend their steps on the rotation. Turned back, a
pair shows what the keys hold, which varies far less (KVQuant quantizes keys before RoPE for this
reason). KVQuant undoes each key's absolute position; undoing the offset within the block needs no
position at all (a format sees a block, not where it sits), and leaves every key of a block turned
by the same angle, its first position's, which moves a pair's range little: measured on SmolLM2 the
same gain as absolute positions (BENCHMARKS.md, issue 42). Rotate-half convention (Hugging Face's):
channel i pairs with i + D/2.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockRope:
    """The model's RoPE angles at offsets 0 .. block_size - 1 of one layer (its local base on a
    sliding layer), as cos and sin [block_size, D/2] fp32."""
    cos: torch.Tensor
    sin: torch.Tensor

    def _turn(self, x: torch.Tensor, sign: float) -> torch.Tensor:
        """x [..., T, H, D], a block's first T tokens (T <= block_size), turned by sign x each
        token's offset angle, in fp32."""
        tokens = x.shape[-3]
        if tokens > self.cos.shape[0]:
            raise ValueError(f"BlockRope: a block of {tokens} tokens, angles for {self.cos.shape[0]}")
        x = x.float()
        cos = self.cos[:tokens].to(x.device)[:, None, :]
        sin = self.sin[:tokens].to(x.device)[:, None, :] * sign
        x1, x2 = x.chunk(2, -1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def unrotate(self, x: torch.Tensor) -> torch.Tensor:
        """Keys as RoPE left them -> as if each sat at the block's first position."""
        return self._turn(x, -1.0)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """`unrotate`'s inverse."""
        return self._turn(x, 1.0)
