"""The block pool's KV events against its own prefix cache: a random workload of prompts that share
prefixes, decodes, forks, frees and the evictions a small pool forces, replayed event by event into
an index, must leave exactly the hashes the prefix cache holds, group by group."""
from __future__ import annotations

import random

import pytest

from kvserve.cache.block_manager import BlockManager
from kvserve.cache.blocks import block_hash
from kvserve.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvserve.cache.kv_groups import KVSpec


def replay(events: list[KVCacheEvent], index: dict[int | None, set[bytes]]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            index.setdefault(event.group_idx, set()).update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            held = index.setdefault(event.group_idx, set())
            assert set(event.block_hashes) <= held, "removed a block never stored"
            held.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            index.clear()


@pytest.mark.parametrize("specs", [(KVSpec(),), (KVSpec(), KVSpec(window=6))], ids=["one group", "hybrid"])
def test_replayed_events_equal_the_prefix_cache(specs: tuple[KVSpec, ...]) -> None:
    rng = random.Random(0)
    bs = 4
    bm = BlockManager(24, bs, specs=specs, events_medium="CPU")
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    live: dict[str, list[int]] = {}
    index: dict[int | None, set[bytes]] = {}
    stored_parents_ok, removed = True, 0
    for step in range(400):
        action = rng.random()
        if action < 0.3 and len(live) < 4:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            seq_id = f"s{step}"
            if bm.allocate_prompt(seq_id, tokens) is not None:
                live[seq_id] = tokens
                bm.register_full_blocks(seq_id, tokens, len(tokens))
        elif action < 0.8 and live:
            seq_id = rng.choice(sorted(live))
            tokens = live[seq_id]
            if bm.allocate(seq_id, len(tokens) + 1) is not None:
                tokens.append(rng.randrange(50))
                bm.register_full_blocks(seq_id, tokens, len(tokens) - 1)
        elif live:
            seq_id = rng.choice(sorted(live))
            del live[seq_id]
            bm.free(seq_id)
        events = bm.pool.take_events()
        for event in events:  # a stored block names its parent's hash and its own tokens
            if isinstance(event, BlockStored):
                assert event.medium == "CPU" and event.block_size == bs
                stored_parents_ok &= block_hash(event.parent_block_hash, tuple(event.token_ids)) == \
                    event.block_hashes[0]
        removed += sum(isinstance(e, BlockRemoved) for e in events)
        replay(events, index)
        groups = range(len(specs))
        want = {(g if len(specs) > 1 else None): set(bm.pool.caches[g]) for g in groups}
        assert {g: index.get(g, set()) for g in want} == want, f"step {step}"
    assert stored_parents_ok
    assert removed > 0  # the small pool evicted cached blocks, and said so


def test_no_events_are_recorded_without_a_medium() -> None:
    bm = BlockManager(8, 4)
    bm.allocate_prompt("a", list(range(9)))
    bm.register_full_blocks("a", list(range(9)), 9)
    assert bm.pool.take_events() == [] and len(bm.cache) == 2
