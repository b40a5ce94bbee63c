"""Every block move of one step, in one object: what the scheduler decided and the runner applies."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from kvserve.cache.compaction import Compaction

if TYPE_CHECKING:
    from kvserve.cache.block_manager import HostBlock


@dataclass(frozen=True)
class BlockOps:
    """Applied in this order before the step's forward pass: compactions (they read blocks their
    sequence gave back, which the other moves may reuse), swaps out (reads of blocks that may be
    reused below), swaps in, offloads to host blocks, copy-on-write copies (they may read blocks a
    preempted sample gave back, which a load may reuse), then blocks loaded from the remote tier.
    Each is what the block manager or swap space returned for the move it decided; the
    compactions a step's evictions decide travel at the head of the next step's (Scheduler.carry)."""
    compactions: tuple[Compaction, ...] = ()
    swap_out: tuple[tuple[int, int, int], ...] = ()  # (device block, tier, slot)
    swap_in: tuple[tuple[int, int, int], ...] = ()   # (tier, slot, device block)
    offloads: tuple[tuple[int, HostBlock], ...] = ()  # (device block, host block)
    loads: tuple[tuple[int, bytes], ...] = ()         # (device block, its pages from the remote tier)
    copies: tuple[tuple[int, int], ...] = ()         # (source block, destination block)
    # (staging slot, block): a compressed pool's freed cached block encoded from its full-precision
    # copy (StagingSlots.release_unowned), sent alone between steps
    seals: tuple[tuple[int, int], ...] = ()

    def then(self, other: "BlockOps") -> "BlockOps":
        """These moves and then `other`'s, kind by kind (the runner applies the kinds in the
        order above whatever their source)."""
        if not other.any():  # most steps: decodes that move nothing
            return self
        if not self.any():
            return other
        return BlockOps(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def any(self) -> bool:
        return bool(self.compactions or self.swap_out or self.swap_in or self.offloads or self.loads or self.copies
                    or self.seals)
