"""BlockManager: lazy block growth, all-or-nothing allocation, and no block ever lost or shared."""
from __future__ import annotations

import random

import pytest
import torch

from kvserve.cache.block_manager import BlockManager, BlockUsage, HostBlock


def check_invariants(bm: BlockManager) -> None:
    """Brute force: every block id is in exactly one place, either one table or the free list."""
    seen: dict[int, str] = {}
    for seq_id, table in bm.tables.items():
        for block in table:
            assert block not in seen, f"block {block} in tables of {seen[block]} and {seq_id}"
            seen[block] = seq_id
    free = list(bm.free_blocks)
    assert len(free) == len(set(free)), "a block is on the free list twice"
    for block in free:
        assert block not in seen, f"block {block} is free and used by {seen[block]}"
    # Nothing lost: used and free together are exactly the pool's ids.
    assert sorted(list(seen) + free) == list(range(bm.num_blocks))
    # A table always covers the tokens it records.
    for seq_id, tokens in bm.num_tokens.items():
        assert len(bm.tables[seq_id]) * bm.block_size >= tokens


@pytest.mark.parametrize("tokens,blocks", [(1, 1), (2, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_only_when_crossing_boundary(tokens: int, blocks: int) -> None:
    # block_size 4: tokens 1..4 fit in one block, the 5th needs a second.
    bm = BlockManager(num_blocks=10, block_size=4)
    assert bm.allocate("a", tokens) is not None
    assert len(bm.tables["a"]) == blocks
    assert len(bm.free_blocks) == 10 - blocks


def test_growing_one_token_at_a_time() -> None:
    # Decode growth: the table grows by a block exactly at tokens 5, 9, 13 and keeps old blocks.
    bm = BlockManager(num_blocks=10, block_size=4)
    history: list[list[int]] = []
    for n in range(1, 14):
        assert bm.allocate("a", n) is not None
        history.append(list(bm.tables["a"]))
    sizes = [len(t) for t in history]
    assert sizes == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4]
    for before, after in zip(history, history[1:]):
        assert after[:len(before)] == before  # earlier blocks never move
    assert bm.num_tokens["a"] == 13


def test_failed_allocate_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    assert bm.allocate("a", 8) is not None  # 2 blocks, 1 left
    tables = {k: list(v) for k, v in bm.tables.items()}
    free = list(bm.free_blocks)
    tokens = dict(bm.num_tokens)
    assert bm.allocate("b", 5) is None      # new sequence needs 2
    assert bm.allocate("a", 13) is None     # existing sequence needs 2 more
    assert bm.allocate("c", 1, reserve_tokens=8) is None  # reservation needs 2
    assert {k: list(v) for k, v in bm.tables.items()} == tables  # no empty table left for b or c
    assert list(bm.free_blocks) == free
    assert bm.num_tokens == tokens
    assert bm.usage().free == 1
    check_invariants(bm)


def test_failed_allocate_after_empty_table() -> None:
    # A sequence recorded with 0 tokens holds an empty table. A later allocate that fails must
    # still change nothing: before it, "a" is known with 0 tokens; after it, it must be the same,
    # and the token record must never outlive the table (usage() and the scheduler rely on both).
    bm = BlockManager(num_blocks=1, block_size=4)
    assert bm.allocate("a", 0) is not None
    assert bm.tables == {"a": []} and bm.num_tokens == {"a": 0}
    assert bm.allocate("a", 8) is None
    assert set(bm.num_tokens) <= set(bm.tables), "num_tokens has an entry with no table"
    assert bm.tables == {"a": []} and bm.num_tokens == {"a": 0}


def test_free_returns_all_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    assert bm.allocate("a", 5) is not None  # 3 blocks
    assert bm.allocate("b", 4) is not None  # 2 blocks
    a_blocks = list(bm.tables["a"])
    bm.free("a")
    assert "a" not in bm.tables and "a" not in bm.num_tokens
    assert set(a_blocks) <= set(bm.free_blocks)
    assert len(bm.free_blocks) == 6
    bm.free("a")                           # freeing twice (or an unknown id) is harmless
    bm.free("nobody")
    assert len(bm.free_blocks) == 6
    bm.free("b")
    assert sorted(bm.free_blocks) == list(range(8))
    check_invariants(bm)


def test_random_operations_keep_invariants() -> None:
    # A seeded random walk of allocations (growing, shrinking requests, reservations) and frees,
    # checked each step against a plain model of how many blocks each sequence should hold.
    rng = random.Random(1234)
    bm = BlockManager(num_blocks=24, block_size=4)
    model: dict[str, int] = {}  # seq id -> blocks held
    for _ in range(2000):
        seq_id = f"s{rng.randrange(8)}"
        if rng.random() < 0.25:
            bm.free(seq_id)
            model.pop(seq_id, None)
        else:
            tokens = rng.randrange(1, 40)  # 0 tokens: see test_failed_allocate_after_empty_table
            reserve = rng.choice([0, 0, rng.randrange(0, 48)])
            have = model.get(seq_id, 0)
            need = -(-max(tokens, reserve) // 4) - have
            free_now = 24 - sum(model.values())
            ok = bm.allocate(seq_id, tokens, reserve) is not None
            assert ok == (need <= free_now)
            if ok:
                model[seq_id] = have + max(need, 0)
                assert bm.num_tokens[seq_id] == tokens
        held = {k: len(v) for k, v in bm.tables.items() if v}
        assert held == {k: v for k, v in model.items() if v}
        assert len(bm.free_blocks) == 24 - sum(model.values())
        check_invariants(bm)


def test_usage_waste_hand_worked() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    assert bm.usage() == BlockUsage(total=10, used=0, free=10, cached=0, tokens=0, allocated_slots=0,
                                    unshared_blocks=0)
    assert bm.usage().waste == 0.0
    bm.allocate("a", 5)   # 2 blocks = 8 slots, 5 tokens
    bm.allocate("b", 3)   # 1 block  = 4 slots, 3 tokens
    u = bm.usage()
    assert (u.used, u.free, u.tokens, u.allocated_slots) == (3, 7, 8, 12)
    assert u.waste == pytest.approx(1 - 8 / 12)  # 4 empty slots of 12
    bm.allocate("c", 2, reserve_tokens=16)  # 4 blocks = 16 slots, 2 tokens
    u = bm.usage()
    assert (u.used, u.tokens, u.allocated_slots) == (7, 10, 28)
    assert u.waste == pytest.approx(18 / 28)


def test_reserve_tokens_allocates_reservation_up_front() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    assert bm.allocate("a", 3, reserve_tokens=20) is not None  # ceil(20/4) = 5 blocks for 3 tokens
    assert len(bm.tables["a"]) == 5
    assert bm.num_tokens["a"] == 3
    # Growing within the reservation takes no new block.
    for n in range(4, 21):
        assert bm.allocate("a", n, reserve_tokens=20) is not None
        assert len(bm.tables["a"]) == 5
    # Past the reservation it grows like any other sequence.
    assert bm.allocate("a", 21, reserve_tokens=20) is not None
    assert len(bm.tables["a"]) == 6
    check_invariants(bm)


def test_allocate_takes_what_is_free_and_no_more() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    assert bm.allocate("a", 4) is not None
    assert bm.allocate("b", 9) is None and "b" not in bm.tables  # a failed allocation changes nothing
    assert bm.allocate("b", 8) is not None
    assert bm.allocate("a", 5) is None and len(bm.tables["a"]) == 1


def test_peak_used() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    assert bm.peak_used == 0
    bm.allocate("a", 12)  # 3
    bm.allocate("b", 8)   # 2 -> 5 used
    assert bm.peak_used == 5
    bm.free("a")          # 2 used; the peak stays
    assert bm.peak_used == 5
    bm.allocate("c", 4)   # 3 used
    assert bm.peak_used == 5
    bm.allocate("d", 16)  # 7 used: new peak
    assert bm.peak_used == 7
    assert bm.allocate("e", 16) is None  # a failed allocation does not move the peak
    assert bm.peak_used == 7


def test_offloaded_entries_are_host_blocks_addressed_past_the_device_pool() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False, num_host_blocks=3)
    assert bm.allocate("a", 7) is not None  # 4 blocks: the whole device pool
    device = list(bm.tables["a"])
    offloads = [bm.offload_coldest("a"), bm.offload_coldest("a")]
    table = bm.tables["a"]
    hosts = [b for b in table if isinstance(b, HostBlock)]
    # The two oldest blocks moved; kernels read them by id num_blocks + host index.
    assert table[2:] == device[2:] and len(hosts) == 2 and table[:2] == hosts
    assert [int(b) for b in hosts] == [4 + b.host_index for b in hosts]
    assert sorted(b.host_index for b in hosts) == [0, 1]
    assert offloads == [(device[0], hosts[0]), (device[1], hosts[1])]
    assert bm.usage().offloaded == 2 and len(bm.free_blocks) == 2
    bm.free("a")
    assert len(bm.free_blocks) == 4 and sorted(b.host_index for b in bm._host_free) == [0, 1, 2]


def _moves(src: list[int], dst: list[int]) -> tuple:
    n = len(src)
    return torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long), torch.tensor(src), torch.tensor(dst)


def test_compaction_frees_the_tail_blocks_hand_count() -> None:
    """50 slots in blocks of 8 (7 blocks) kept down to 20 (3 blocks): 4 blocks come back; slots
    map through the table as it stood, sources in released blocks included."""
    bm = BlockManager(num_blocks=10, block_size=8, enable_prefix_caching=False)
    assert bm.allocate("a", 50) is not None
    table = list(bm.tables["a"])
    c = bm.compact("a", *_moves([45, 49], [3, 17]), kept=20)
    assert c is not None
    assert bm.tables["a"] == table[:3] and bm.num_tokens["a"] == 20
    assert bm.evicted_blocks == 4 and len(bm.free_blocks) == 10 - 3
    assert c.copies == ()
    assert c.src.tolist() == [table[5] * 8 + 5, table[6] * 8 + 1]
    assert c.dst.tolist() == [table[0] * 8 + 3, table[2] * 8 + 1]
    bm.free("a")
    assert len(bm.free_blocks) == 10


def test_compaction_copies_shared_and_cached_blocks_it_writes() -> None:
    """A forked sequence's written blocks are copied (the sibling keeps the originals); a block in
    the prefix cache is copied too, so the cached prefix stays intact."""
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=True)
    tokens = list(range(16))
    assert bm.allocate_prompt("a", tokens).cached == 0
    bm.register_full_blocks("a", tokens, 16)
    bm.fork("a", "b")
    original = list(bm.tables["a"])
    # Keep 6 slots: writes land in block 0 (slot 2) and block 1 (slot 5), and block 1 is partial.
    c = bm.compact("a", *_moves([14, 15], [2, 5]), kept=6)
    assert c is not None
    assert [s for s, _ in c.copies] == original[:2]
    fresh = [d for _, d in c.copies]
    assert bm.tables["a"] == fresh and bm.tables["b"] == original
    assert all(bm.blocks[b].ref_count == 1 for b in original)  # "b" alone holds them now
    assert c.dst.tolist() == [fresh[0] * 4 + 2, fresh[1] * 4 + 1]
    assert c.src.tolist() == [original[3] * 4 + 2, original[3] * 4 + 3]  # read before release
    bm.free("b")
    assert bm.allocate_prompt("c", tokens + [99]).cached == 16  # the whole prefix is still served
    bm.free("a")
    bm.free("c")
    assert len(bm.free_blocks) == 12


def test_compaction_changes_nothing_when_copies_cannot_be_made() -> None:
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    assert bm.allocate("a", 16) is not None
    bm.fork("a", "b")
    assert bm.compact("a", *_moves([13], [1]), kept=8) is None
    assert bm.tables["a"] == bm.tables["b"]


@pytest.mark.parametrize("caching", [True, False])
def test_unregistered_blocks_are_the_full_ones_register_full_blocks_would_hash(caching: bool) -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=caching)
    tokens = list(range(10))
    assert bm.allocate_prompt("a", tokens).cached == 0
    assert not bm.has_unregistered_blocks("a", 3)  # no block is full yet
    assert bm.has_unregistered_blocks("a", 10) == caching  # blocks 0 and 1 are
    assert len(bm.register_full_blocks("a", tokens, 10)) == (2 if caching else 0)
    assert not bm.has_unregistered_blocks("a", 10)
    assert bm.allocate("a", 12) is not None
    assert bm.has_unregistered_blocks("a", 12) == caching  # block 2 filled
