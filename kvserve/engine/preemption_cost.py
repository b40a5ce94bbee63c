"""Whether a preempted sequence's blocks are copied out (swap) or its tokens recomputed later."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# Rough device speeds for the "auto" choice: recomputing a sequence costs about 2 * params FLOPs
# per token, swapping costs its KV bytes twice (out and back) over the link.
_FLOPS = {"cpu": 2e11, "cuda": 1e14}
_COPY_BYTES_PER_S = {"cpu": 2e10, "cuda": 2e10}


@dataclass(frozen=True)
class PreemptionCost:
    mode: str  # EngineConfig.preemption_mode: "recompute", "swap" or "auto"
    num_params: int
    device_kind: str
    block_bytes: int
    blocks_for: Callable[[int], int]

    def prefer_swap(self, num_tokens: int) -> bool:
        if self.mode != "auto":
            return self.mode == "swap"
        recompute_s = num_tokens * 2 * self.num_params / _FLOPS.get(self.device_kind, 2e11)
        swap_s = 2 * self.blocks_for(num_tokens) * self.block_bytes / _COPY_BYTES_PER_S.get(self.device_kind, 2e10)
        return swap_s < recompute_s
