"""Gives each sequence a block table and hands out pool blocks as sequences grow."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockUsage:
    total: int
    used: int
    free: int
    tokens: int           # slots holding a token
    allocated_slots: int  # slots in allocated blocks

    @property
    def waste(self) -> float:
        """Fraction of allocated slots that hold no token."""
        return 1 - self.tokens / self.allocated_slots if self.allocated_slots else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.tables: dict[str, list[int]] = {}
        self.num_tokens: dict[str, int] = {}
        self.peak_used = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        have = len(self.tables.get(seq_id, ()))
        return self.blocks_for(num_tokens) - have <= len(self.free_blocks)

    def allocate(self, seq_id: str, num_tokens: int, reserve_tokens: int = 0) -> bool:
        """Grow `seq_id`'s table to hold `max(num_tokens, reserve_tokens)` slots and record that it
        holds `num_tokens` tokens. Allocates nothing and returns False if blocks are short."""
        table = self.tables.get(seq_id, [])
        need = self.blocks_for(max(num_tokens, reserve_tokens)) - len(table)
        if need > len(self.free_blocks):
            return False
        self.tables[seq_id] = table
        table.extend(self.free_blocks.popleft() for _ in range(need))
        self.num_tokens[seq_id] = num_tokens
        self.peak_used = max(self.peak_used, self.num_blocks - len(self.free_blocks))
        return True

    def free(self, seq_id: str) -> None:
        self.free_blocks.extend(self.tables.pop(seq_id, ()))
        self.num_tokens.pop(seq_id, None)

    def usage(self) -> BlockUsage:
        used = self.num_blocks - len(self.free_blocks)
        return BlockUsage(total=self.num_blocks, used=used, free=len(self.free_blocks),
                          tokens=sum(self.num_tokens.values()),
                          allocated_slots=sum(len(t) for t in self.tables.values()) * self.block_size)
