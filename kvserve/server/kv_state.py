"""A JSON picture of the KV pool for the dashboard: every block's state and owner."""
from __future__ import annotations

import time
from typing import Any

from kvserve.cache.block_manager import BlockManager
from kvserve.cache.blocks import on_device
from kvserve.engine.llm_engine import LLMEngine


def block_states(bm: BlockManager) -> tuple[str, list[str | None]]:
    """Per device block, its state as one letter (F free, U in use, S shared, C cached, N the
    sliding groups' null block) and the sequence whose table holds it first (None when unowned)."""
    owners: list[str | None] = [None] * bm.num_blocks
    for tables in bm.group_tables:
        for seq_id, table in tables.items():
            for block_id in table:
                if on_device(block_id) and bm.pool.owned(block_id) and owners[block_id] is None:
                    owners[block_id] = seq_id
    states = "".join(("S" if b.ref_count > 1 else "U") if b.ref_count else ("C" if b.hash is not None else "F")
                     for b in bm.blocks)
    if bm.reserved:
        states = "N" + states[1:]
    return states, owners


def kv_state(engine: LLMEngine, expose_request_ids: bool = False) -> dict[str, Any]:
    """Runs on the engine thread. Owners are indices into `sequences` (-1: none), which keeps
    the payload small for pools of thousands of blocks. Without `expose_request_ids` the
    sequences are numbered, not named: a request id is one client's business."""
    states, owners = block_states(engine.block_manager)
    swap_owners: list[tuple[str, list[str | None]]] = []
    if engine.swap is not None:
        for tier in engine.swap.tiers:
            swap_owners.append((tier.name, [None] * tier.num_slots))
        for seq_id, places in engine.swap.swapped.items():
            for tier, slot in places:
                swap_owners[tier][1][slot] = seq_id
    names = sorted({o for o in owners if o} | {o for _, tier in swap_owners for o in tier if o})
    index = {name: i for i, name in enumerate(names)}
    sched = engine.scheduler
    return {
        "time": time.time(),
        "model": engine.model_name,
        "block_size": engine.block_manager.block_size,
        "num_blocks": engine.block_manager.num_blocks,
        # Hybrid models: every group's blocks share the grid (N marks the sliding groups' null block).
        "kv_cache_groups": [{"kind": kind, "layers": list(group.layers), "blocks": held} for kind, group, held in
                            zip(engine.kv_groups.kinds(), engine.kv_groups.groups, engine.block_manager.group_blocks())],
        "states": states,
        "owners": [index.get(o, -1) for o in owners],  # type: ignore[arg-type]
        "swap": [{"name": name, "owners": [index.get(o, -1) for o in tier]}  # type: ignore[arg-type]
                 for name, tier in swap_owners],
        "sequences": names if expose_request_ids else [f"sequence {i}" for i in range(len(names))],
        "running": len(sched.running), "waiting": len(sched.waiting), "swapped": len(sched.swapped),
        "tokens_generated": engine.tokens_generated,
        "prefix_cache_hit_rate": engine.block_manager.prefix_stats.hit_rate,
        "preemptions": dict(sched.preemptions),
        "blocks_freed_by_eviction": engine.block_manager.evicted_blocks,
        "evicted_tokens": dict(engine.evicted_tokens),
    }
