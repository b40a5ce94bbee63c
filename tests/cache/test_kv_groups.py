"""KV cache groups and the hybrid block manager: a sliding group keeps only the blocks its window
sees (counted by hand), prefix hits follow the stated rule, forks share, and nothing leaks."""
from __future__ import annotations

import random

import pytest

from kvserve.cache.block_manager import BlockManager
from kvserve.cache.kv_groups import NULL_BLOCK, KVGroups, KVSpec

BS, W = 4, 10  # a window that is not a multiple of the block


def test_groups_of_gemma3s_pattern() -> None:
    """18 layers, every sixth global (Gemma 3 270M): one full group of 3 and five sliding of 3."""
    windows = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    groups = KVGroups.of(windows)
    assert groups.layers_per_block == 3 and len(groups.groups) == 6
    assert groups.groups[0].spec == KVSpec(None) and groups.groups[0].layers == (5, 11, 17)
    assert [g.layers for g in groups.groups[1:]] == [(0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)]
    assert groups.layer_map(18)[11] == (0, 1) and groups.layer_map(18)[6] == (2, 2)
    # Every layer has exactly one (group, tensor) place.
    assert sorted(groups.layer_map(18)) == sorted({(g, s) for g in range(6) for s in range(3)})
    off = KVGroups.of(windows, hybrid=False)
    assert len(off.groups) == 1 and off.layers_per_block == 18 and off.groups[0].spec.window is None
    mistral = KVGroups.of((4096,) * 32)
    assert len(mistral.groups) == 1 and mistral.windowed and mistral.layers_per_block == 32


def test_the_group_size_wastes_the_fewest_tensors() -> None:
    """The largest group size leaving at most 5% of a block's tensors spare. Gemma 3 1B: 26 layers,
    4 global: groups of 4 would leave a last sliding group of 2 (2 of 28 spare); groups of 2 none.
    4B: 5 global of 34: groups of 5, one of 35 spare. 27B: 10 global of 62: groups of 5 (3 of 65)."""
    def pattern(layers: int, window: int) -> tuple[int | None, ...]:
        return tuple(None if (i + 1) % 6 == 0 else window for i in range(layers))
    assert (KVGroups.of(pattern(26, 512)).layers_per_block, len(KVGroups.of(pattern(26, 512)).groups)) == (2, 13)
    assert (KVGroups.of(pattern(34, 1024)).layers_per_block, len(KVGroups.of(pattern(34, 1024)).groups)) == (5, 7)
    assert KVGroups.of(pattern(62, 1024)).layers_per_block == 5
    # 3 full and 4 sliding: groups of 3 (2 of 9 spare) or 2 (1 of 8) waste too much: groups of 1.
    assert KVGroups.of((None, None, None, 8, 8, 8, 8)).layers_per_block == 1


def _held(bm: BlockManager, seq: str, g: int) -> list[int]:
    return [b for b in bm.group_tables[g][seq] if b != NULL_BLOCK]


def test_a_long_decode_holds_the_window_only() -> None:
    """A sequence decoded to 10x the window: the sliding group never holds more than
    ceil(window / block) + 1 blocks, the full group holds every block, and the pool's counters
    say so."""
    bm = BlockManager(200, BS, specs=(KVSpec(), KVSpec(W)))
    assert bm.allocate_prompt("s", list(range(1, 6))) is not None
    most = -(-W // BS) + 1
    for n in range(6, 10 * W + 1):
        assert bm.allocate("s", n, num_computed=n - 1) == ()
        held = _held(bm, "s", 1)
        assert len(held) <= most
        # Exactly the blocks of positions n - W .. n - 1 (the window of the newest token).
        assert len(held) == (n - 1) // BS - max(0, n - W) // BS + 1
        assert len(_held(bm, "s", 0)) == -(-n // BS)
        assert bm.usage().used == len(held) + -(-n // BS) == bm.blocks_held(n)
    bm.free("s")
    assert bm.usage().used == 0 and not bm.sequence_state_left()


def test_chunked_prefill_holds_the_window_and_the_chunk() -> None:
    """With step_tokens, a sliding group takes blocks for the next chunk only."""
    bm = BlockManager(200, BS, specs=(KVSpec(), KVSpec(W)), step_tokens=8)
    prompt = list(range(1, 101))
    assert bm.allocate_prompt("s", prompt) is not None
    assert len(bm.group_tables[0]["s"]) == 25 and len(bm.group_tables[1]["s"]) == 2
    for computed in range(8, 100, 8):
        bm.allocate("s", 100, num_computed=computed)
        table = bm.group_tables[1]["s"]
        assert len(table) == -(-min(100, computed + 8) // BS)
        # The queries from `computed` on see keys from computed - W + 1: the blocks before are gone.
        first = max(0, computed - W + 1) // BS
        assert all(b == NULL_BLOCK for b in table[:first]) and NULL_BLOCK not in table[first:]
    bm.free("s")
    assert bm.usage().used == 0


def test_a_chunk_counts_the_blocks_its_window_releases() -> None:
    """A chunk that takes as many sliding blocks as its window lets go fits a pool with none free
    (worked by hand: block 4, window 8, 8-token chunks, a 24-token prompt: the full group holds 6
    blocks, the sliding one 4 from the second chunk on), and the null entries before a window's
    start take no block."""
    bm = BlockManager(11, BS, specs=(KVSpec(), KVSpec(8)), step_tokens=8)  # 10 blocks and the null one
    assert bm.allocate_prompt("s", list(range(1, 25))) is not None
    assert bm.allocate("s", 24, num_computed=8) == () and not bm.free_blocks
    # Queries 16..23 see keys from 9 on: blocks 0 and 1 go, blocks 4 and 5 come.
    assert bm.allocate("s", 24, num_computed=16) == ()
    assert bm.group_tables[1]["s"][:2] == [NULL_BLOCK] * 2 and NULL_BLOCK not in bm.group_tables[1]["s"][2:]
    assert not bm.free_blocks and len(bm.group_tables[1]["s"]) == 6
    bm.free("s")
    assert bm.usage().used == 0
    # A table made at 32 computed tokens (a sequence coming back): 10 full blocks and the window's
    # 4 (blocks 6-9), exactly the 14 a pool of 15 gives.
    bm = BlockManager(15, BS, specs=(KVSpec(), KVSpec(8)), step_tokens=8)
    assert bm.allocate("t", 40, num_computed=32) == ()
    assert bm.group_tables[1]["t"][:6] == [NULL_BLOCK] * 6 and not bm.free_blocks
    bm.free("t")
    assert bm.usage().used == 0 and not bm.sequence_state_left()


def test_a_prefix_hit_needs_the_full_prefix_and_the_windows_last_blocks() -> None:
    bm = BlockManager(200, BS, specs=(KVSpec(), KVSpec(W)))
    prompt = list(range(1, 42))
    bm.allocate_prompt("a", prompt)
    bm.register_full_blocks("a", prompt, len(prompt))
    bm.free("a")
    # Everything cached: 10 full blocks of the 41-token prompt (the last token is always run).
    assert bm.allocate_prompt("b", prompt).cached == 40
    # The sliding group's table: NULL before the window of position 40, shared blocks after.
    assert bm.group_tables[1]["b"][:(40 - W + 1) // BS] == [NULL_BLOCK] * ((40 - W + 1) // BS)
    bm.free("b")
    # Drop the sliding group's block 8 (positions 32..35): a hit of 10 blocks would need it (the
    # window of position 40 starts at 31), so does 9 (from 27); 8 does not (from 23: blocks 5..7).
    bm.pool.forget(next(b for b in bm.pool.caches[1].values() if bm.blocks[b].token_ids == tuple(prompt[32:36])))
    assert bm.allocate_prompt("c", prompt).cached == 32
    # A full group's miss caps every group.
    bm.free("c")
    full_victim = next(b for b in bm.pool.caches[0].values() if bm.blocks[b].token_ids == tuple(prompt[8:12]))
    bm.pool.forget(full_victim)
    assert bm.allocate_prompt("d", prompt).cached == 8
    bm.free("d")
    assert bm.usage().used == 0


def test_forks_share_every_group_and_copy_on_write() -> None:
    bm = BlockManager(200, BS, specs=(KVSpec(), KVSpec(W)))
    bm.allocate_prompt("p", list(range(1, 23)))
    for n in range(23, 30):
        bm.allocate("p", n)
    bm.fork("p", "c")
    copies = bm.allocate("c", 30)
    # The newest token's block is copied in both groups (shared, and the same block index 7).
    assert len(copies) == 2 and {s for s, _ in copies} == {bm.group_tables[0]["p"][7], bm.group_tables[1]["p"][7]}
    bm.free("p")
    bm.free("c")
    assert bm.usage().used == 0 and not bm.sequence_state_left()


@pytest.mark.parametrize("seed", range(3))
def test_random_traffic_never_leaks_a_block(seed: int) -> None:
    """Admissions, prefix hits, decodes, forks and frees in a small pool: every owned block is
    counted once per table entry, and the pool is whole at the end."""
    rng = random.Random(seed)
    bm = BlockManager(60, BS, specs=(KVSpec(), KVSpec(W), KVSpec(W)), step_tokens=rng.choice([None, 8]))
    live: dict[str, int] = {}
    prefix = [rng.randrange(1, 50) for _ in range(12)]
    for step in range(300):
        if live and rng.random() < 0.3:
            seq = rng.choice(sorted(live))
            bm.free(seq)
            del live[seq]
        elif rng.random() < 0.4:
            prompt = prefix[:rng.randrange(0, 12)] + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 20))]
            grant = bm.allocate_prompt(f"s{step}", prompt)
            if grant is not None:
                # Its prefill in chunks of 8, each registering the blocks it filled.
                computed = grant.cached
                while computed < len(prompt) and bm.allocate(f"s{step}", len(prompt), num_computed=computed) is not None:
                    computed = min(len(prompt), computed + 8)
                    bm.register_full_blocks(f"s{step}", prompt, computed)
                live[f"s{step}"] = len(prompt)
        elif live and rng.random() < 0.1:
            parent = rng.choice(sorted(live))
            bm.fork(parent, f"f{step}")
            live[f"f{step}"] = live[parent]
        else:
            for seq in sorted(live):
                if bm.allocate(seq, live[seq] + 1) is not None:
                    live[seq] += 1
        refs: dict[int, int] = {}
        for tables in bm.group_tables:
            for table in tables.values():
                for b in table:
                    if b != NULL_BLOCK:
                        refs[b] = refs.get(b, 0) + 1
        assert all(bm.blocks[b].ref_count == n for b, n in refs.items())
        assert all(bm.blocks[b].ref_count == 0 for b in bm.free_blocks)
        assert len(refs) + len(bm.free_blocks) == bm.capacity
    for seq in list(live):
        bm.free(seq)
    assert bm.usage().used == 0 and not bm.sequence_state_left()
