"""Prefix caching and sharing in the BlockManager, against hand-worked expectations."""
from __future__ import annotations

from kvserve.cache.block_manager import BlockManager, block_hash


def run_prompt(bm: BlockManager, seq_id: str, tokens: list[int]) -> int | None:
    """Admit, pretend the prefill wrote every token, and register the full blocks."""
    grant = bm.allocate_prompt(seq_id, tokens)
    if grant is None:
        return None
    bm.register_full_blocks(seq_id, tokens, len(tokens))
    return grant.cached


def test_shared_prefix_reuses_blocks_and_leaves_the_last_token() -> None:
    bm = BlockManager(16, 4)
    system = list(range(100, 112))  # 3 full blocks
    assert run_prompt(bm, "a", system + [1, 2]) == 0
    assert run_prompt(bm, "b", system + [7, 8, 9]) == 12
    assert bm.tables["a"][:3] == bm.tables["b"][:3]
    assert bm.tables["a"][3] != bm.tables["b"][3]
    assert all(bm.blocks[b].ref_count == 2 for b in bm.tables["a"][:3])
    # A prompt that is exactly cached still computes its last token: 8 of 12 reused, not 12.
    assert run_prompt(bm, "c", system) == 8
    assert bm.prefix_stats.prompt_tokens == 14 + 15 + 12
    assert bm.prefix_stats.cached_tokens == 12 + 8
    usage = bm.usage()
    assert usage.unshared_blocks == 4 + 4 + 3 and usage.used == 4 + 1 + 1


def test_same_tokens_after_a_different_prefix_do_not_hit() -> None:
    bm = BlockManager(16, 4)
    run_prompt(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert run_prompt(bm, "b", [9, 9, 9, 9, 5, 6, 7, 8, 9]) == 0


def test_hash_collision_is_caught_by_comparing_tokens() -> None:
    bm = BlockManager(8, 4)
    run_prompt(bm, "a", [1, 2, 3, 4, 5])
    block = bm.blocks[bm.tables["a"][0]]
    # Forge a collision: the cache entry for [9, 9, 9, 9] points at a block holding [1, 2, 3, 4].
    bm.cache[block_hash(None, (9, 9, 9, 9))] = block.block_id
    assert run_prompt(bm, "b", [9, 9, 9, 9, 1]) == 0


def test_finished_blocks_stay_cached_until_needed_then_lru_deepest_first() -> None:
    bm = BlockManager(6, 2)
    run_prompt(bm, "old", [1, 2, 3, 4, 5])   # blocks: [1,2] [3,4] [5]
    run_prompt(bm, "new", [7, 8, 9, 10, 11])
    old, new = bm.tables["old"], bm.tables["new"]
    bm.free("old")
    bm.free("new")
    usage = bm.usage()
    assert (usage.used, usage.cached, usage.free) == (0, 4, 2)
    # Reuse order: the two partial blocks (nothing cached) first, then the older sequence's
    # full blocks deepest first, then the newer one's.
    assert bm.free_blocks == [new[2], old[2], old[1], old[0], new[1], new[0]]
    assert run_prompt(bm, "x", [50, 51, 52, 53, 54, 55]) == 0   # takes 3 blocks: evicts old[1]
    assert old[1] in bm.tables["x"] and old[0] not in bm.tables["x"]
    assert run_prompt(bm, "again", [1, 2, 3, 4, 6]) == 2         # [1,2] still cached; [3,4] evicted


def test_a_hit_refreshes_recency() -> None:
    bm = BlockManager(4, 2)
    run_prompt(bm, "a", [1, 2, 3])
    run_prompt(bm, "b", [4, 5, 6])
    bm.free("a")
    bm.free("b")
    run_prompt(bm, "a2", [1, 2, 9])   # touches [1,2]; its partial block takes a free one
    bm.free("a2")
    # [4,5] is now the least recently used cached block, so it goes before [1,2].
    cached_order = [b for b in bm.free_blocks if bm.blocks[b].hash is not None]
    assert [bm.blocks[b].token_ids for b in cached_order] == [(4, 5), (1, 2)]


def test_fork_shares_and_copy_on_write_splits_the_partial_block() -> None:
    bm = BlockManager(8, 4)
    run_prompt(bm, "p", [1, 2, 3, 4, 5, 6])        # blocks [1..4] full, [5,6] partial
    bm.fork("p", "c")
    assert bm.tables["c"] == bm.tables["p"] and bm.usage().used == 2
    shared_partial = bm.tables["p"][1]
    copies = bm.allocate("c", 7)                   # c writes token 7 into the shared block
    assert copies == ((shared_partial, bm.tables["c"][1]),)
    assert bm.tables["c"][0] == bm.tables["p"][0]  # the full block stays shared
    assert bm.blocks[shared_partial].ref_count == 1
    assert bm.allocate("p", 7) == ()               # p is now sole owner: no copy
    bm.free("p")
    bm.free("c")
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_disabled_prefix_caching_never_hits() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    run_prompt(bm, "a", [1, 2, 3, 4, 5])
    assert run_prompt(bm, "b", [1, 2, 3, 4, 5]) == 0 and not bm.cache


def test_live_twin_takes_over_the_cache_entry() -> None:
    # Two identical prompts prefilled in the same step both compute block [1, 2]; only one can
    # be cached. When the cached one is unowned and the other still live, the live one takes over,
    # so evicting the unowned copy does not lose the prefix.
    bm = BlockManager(5, 2)
    prompt = [1, 2, 3]
    bm.allocate_prompt("a", prompt)
    bm.allocate_prompt("b", prompt)
    bm.register_full_blocks("a", prompt, 3)
    bm.free("a")
    bm.register_full_blocks("b", prompt, 3)
    assert bm.cache[block_hash(None, (1, 2))] == bm.tables["b"][0]
    bm.allocate("x", 6)  # takes three blocks: every unowned one
    bm.free("x")
    assert run_prompt(bm, "c", prompt) == 2


def test_a_prompt_takes_at_most_max_cached_tokens_whole_blocks() -> None:
    bm = BlockManager(64, 4)
    prompt = list(range(100, 121))  # 5 full blocks and a token, all cached below
    run_prompt(bm, "a", prompt)
    assert [bm.allocate_prompt(s, prompt, max_cached=m).cached
            for s, m in (("b", None), ("c", 11), ("d", 12), ("e", 3), ("f", 0))] == [20, 8, 12, 0, 0]
    assert bm.tables["c"][:2] == bm.tables["a"][:2] and bm.tables["c"][2] != bm.tables["a"][2]
