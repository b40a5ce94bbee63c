"""Preemption by swap: host tier, then the memory-mapped tier; outputs as without preemption."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvserve import LLM

from tests.engine.test_llm_engine import GREEDY, PROMPTS, token_ids

# The tiny model's KV is 512 bytes per token: one 16-token block is 8 KiB.
SMALL_POOL = dict(kv_cache_memory="64KiB", enable_prefix_caching=False)


def assert_tiers_empty(llm: LLM) -> None:
    swap = llm.engine.swap
    assert not swap.swapped
    assert all(len(t.free) == t.num_slots for t in swap.tiers)


def test_swap_to_host_and_disk_then_resume(tiny_llm: Callable[..., LLM], tmp_path: Path) -> None:
    reference = token_ids(tiny_llm())
    llm = tiny_llm(preemption_mode="swap", host_swap_memory="8KiB", disk_swap_memory="1MiB",
                   swap_dir=str(tmp_path), **SMALL_POOL)
    assert [t.name for t in llm.engine.swap.tiers] == ["host", "disk"]
    assert list(tmp_path.glob("kvserve-swap-*"))  # the file tier is a real file
    assert token_ids(llm) == reference
    sched, swap = llm.engine.scheduler, llm.engine.swap
    assert sched.preemptions["swap"] > 0 and sched.preemptions["recompute"] == 0
    assert swap.swap_outs["host"] > 0 and swap.swap_outs["disk"] > 0
    assert swap.swap_ins == swap.swap_outs
    assert_tiers_empty(llm)


def test_full_tiers_fall_back_to_recompute(tiny_llm: Callable[..., LLM]) -> None:
    reference = token_ids(tiny_llm())
    llm = tiny_llm(preemption_mode="swap", host_swap_memory="8KiB", disk_swap_memory="0", **SMALL_POOL)
    assert token_ids(llm) == reference
    assert llm.engine.scheduler.preemptions["recompute"] > 0
    assert_tiers_empty(llm)


def test_auto_mode_swaps_when_copying_is_cheaper(tiny_llm: Callable[..., LLM]) -> None:
    reference = token_ids(tiny_llm())
    llm = tiny_llm(preemption_mode="auto", host_swap_memory="1MiB", **SMALL_POOL)
    # Recomputing costs 2 x params FLOPs per token; copying a 16-token block twice is far cheaper.
    assert llm.engine._prefer_swap(40)
    assert token_ids(llm) == reference
    assert llm.engine.scheduler.preemptions["swap"] > 0
    assert_tiers_empty(llm)


def test_aborting_a_swapped_sequence_frees_its_slots(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm(preemption_mode="swap", host_swap_memory="1MiB", **SMALL_POOL)
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    while not engine.scheduler.swapped:
        engine.step()
    victim = engine.scheduler.swapped[0]
    engine.abort(victim.request_id)
    assert victim.seq_id not in engine.swap.swapped
    for request_id in ids:
        engine.abort(request_id)
    engine.step()  # applies the copies recorded before the aborts
    assert_tiers_empty(llm)


def test_bad_swap_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(model="random:tiny", preemption_mode="sometimes")
    with pytest.raises(ValueError, match="host_swap_memory"):
        LLM(model="random:tiny", host_swap_memory="lots")
