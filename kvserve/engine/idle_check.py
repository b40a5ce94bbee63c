"""What an engine with no request must hold: nothing of any request. Checked after every test
that drives an engine (tests/conftest.py), the way SGLang and vLLM check their KV managers after
each test, so a leak fails the test that caused it rather than a later one.

An idle engine has every device block free or cached (unowned, full, evictable), no block table,
sequence length or eviction state left in the block manager, every staging slot of a compressed
pool free, no host (offload) block and no swap slot in use, empty scheduler queues, no request
or unread token in the engine, and no remote-tier load pending.
"""
from __future__ import annotations

from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine


def idle_problems(engine: LLMEngine) -> list[str]:
    """What an engine that has no unfinished request still holds (empty when all is well)."""
    problems: list[str] = []
    bm = engine.block_manager
    usage = bm.usage()
    if usage.used or usage.free + usage.cached != usage.total:
        problems.append(f"{usage.used} device blocks still owned (free {usage.free} + cached {usage.cached} "
                        f"of {usage.total})")
    owned = [b.block_id for b in bm.blocks[bm.reserved:] if b.ref_count]  # not the null block
    if owned:
        problems.append(f"blocks with a reference count: {owned[:8]}{'...' if len(owned) > 8 else ''}")
    problems += [f"block manager: {left}" for left in bm.sequence_state_left()]
    if bm.staging is not None and bm.staging.stage_of:
        problems.append(f"staging slots held by blocks {sorted(bm.staging.stage_of)[:8]}")
    if engine.swap is not None:
        problems += [f"swap tier {u.name}: {u.used} slots in use" for u in engine.swap.usage() if u.used]
    sched = engine.scheduler
    if sched.carries():
        problems.append("the scheduler carries block moves for a step that never came")
    for name in ("running", "waiting", "swapped"):
        if queue := getattr(sched, name):
            problems.append(f"scheduler.{name} holds {len(queue)} sequences")
    problems += [f"engine: {left}" for left in engine.request_state_left()]
    return problems
