"""Every block move of one step, in one object: what the scheduler decided and the runner applies."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.cache.compaction import Compaction

if TYPE_CHECKING:
    from kvserve.cache.block_manager import BlockManager, HostBlock
    from kvserve.cache.swap_space import SwapSpace


@dataclass(frozen=True)
class BlockOps:
    """Applied in this order before the step's forward pass: compactions (they read blocks their
    sequence gave back, which the other moves may reuse), swaps out (reads of blocks that may be
    reused below), swaps in, offloads to host blocks, blocks loaded from the remote tier, then
    copy-on-write copies."""
    compactions: tuple[Compaction, ...] = ()
    swap_out: tuple[tuple[int, int, int], ...] = ()  # (device block, tier, slot)
    swap_in: tuple[tuple[int, int, int], ...] = ()   # (tier, slot, device block)
    offloads: tuple[tuple[int, HostBlock], ...] = ()  # (device block, host block)
    loads: tuple[tuple[int, bytes], ...] = ()         # (device block, its pages from the remote tier)
    copies: tuple[tuple[int, int], ...] = ()         # (source block, destination block)

    @classmethod
    def collect(cls, block_manager: BlockManager, swap: SwapSpace | None) -> "BlockOps":
        """The moves recorded since the last step by the block manager (allocations, offloads)
        and the swap space (preemptions, readmissions), taken from them."""
        swap_out, swap_in = swap.take() if swap is not None else ((), ())
        compactions, offloads, loads, copies = block_manager.take_moves()
        return cls(tuple(compactions), tuple(swap_out), tuple(swap_in), tuple(offloads), tuple(loads), tuple(copies))

