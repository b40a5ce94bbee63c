"""What a pool's layer reads of one step, typed: the step's slots and tables (`PageStep`, which
attention's `StepMetadata` provides), and a compressed pool's plan for the step's writes
(`WritePlan`, which `QuantizedKVPool.write_plan` makes from the block manager's staging plan)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class WritePlan:
    """Where this step's tokens go; indices into the step's [T] new tokens."""
    per_token: bool                    # no staging: every token is encoded into its slot
    staged_tokens: torch.Tensor        # into staging slot * block_size + offset
    staged_slots: torch.Tensor
    seal_stages: torch.Tensor          # encoded from staging into their blocks after attention
    seal_blocks: torch.Tensor
    stage_of: torch.Tensor | None      # [num_blocks] staging slot of each block this step reads
                                       # from staging (sealed ones included), -1: none
    stage_copies: tuple[tuple[int, int], ...] = ()  # copy-on-write: (source slot, destination slot)


class PageStep(Protocol):
    """The step as a layer's `write`, `seal` and `gather` read it."""
    @property
    def slot_mapping(self) -> torch.Tensor: ...     # [T] flat pool slot of each new token
    @property
    def block_tables(self) -> torch.Tensor: ...     # [B, max_blocks] block ids
    @property
    def offloaded(self) -> bool: ...                # a table holds host blocks
    @property
    def kv_plan(self) -> WritePlan | None: ...      # a compressed pool's plan; None for dense pages
