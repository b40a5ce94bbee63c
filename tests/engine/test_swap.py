"""Preemption by swap: host tier, then the memory-mapped tier; outputs as without preemption."""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams

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


def test_a_sequence_swapped_out_needing_the_whole_pool_comes_back(tiny_llm: Callable[..., LLM]) -> None:
    """A swapped sequence whose next token needs every block cannot leave a block of headroom for
    running ones: with nothing running it comes back (or is recomputed) instead of waiting forever."""
    long_prompt = [(7 * i) % 127 + 1 for i in range(111)]  # + 17 outputs = the pool's 8 x 16 slots
    prompts, params = [list(range(1, 6)), long_prompt], [dataclasses.replace(GREEDY, max_tokens=11),
                                                         dataclasses.replace(GREEDY, max_tokens=17)]
    reference = token_ids(tiny_llm(), prompts, params)
    llm = tiny_llm(preemption_mode="swap", host_swap_memory="1MiB", **SMALL_POOL)
    engine = llm.engine
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    outputs, steps = {}, 0
    while engine.has_unfinished() and steps < 200:
        outputs |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
        steps += 1
    assert engine.scheduler.preemptions["swap"] > 0
    assert [outputs.get(str(i)) for i in range(2)] == reference
    assert_tiers_empty(llm)


def test_a_salted_sequence_keeps_its_salt_through_a_swap(tiny_llm: Callable[..., LLM]) -> None:
    """The blocks a swapped-in sequence registers stay under its tenant's salt: another tenant
    sending the same prompt never hits them."""
    llm = tiny_llm(preemption_mode="swap", host_swap_memory="1MiB", max_num_seqs=4, kv_cache_memory="64KiB")
    engine = llm.engine
    prompts = [[(13 * i + 7 * j) % 127 + 1 for j in range(40)] for i in range(4)]
    for prompt in prompts:
        engine.add_request(prompt, dataclasses.replace(GREEDY, max_tokens=60), cache_salt="tenant-a")
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.preemptions["swap"] > 0
    stats = engine.block_manager.prefix_stats
    before = stats.cached_tokens
    llm.generate(prompts, dataclasses.replace(GREEDY, max_tokens=1), use_tqdm=False)
    assert stats.cached_tokens == before
    llm.generate(prompts, dataclasses.replace(GREEDY, max_tokens=1), use_tqdm=False)  # the control
    assert stats.cached_tokens > before


def run_with_a_failed_step(llm: LLM, kind: str | None) -> dict[str, list[int]]:
    """Seeded samples of four prompts through a pool that swaps; the first step with a `kind`
    move fails before its forward pass, and the requests running then end, as the server ends
    them. Returns the finished requests' tokens."""
    engine, runner = llm.engine, llm.engine.runner
    prepare, failed = runner.prepare, []

    def faulty(seqs, num_scheduled, ops, *args):  # type: ignore[no-untyped-def]
        if kind is not None and getattr(ops, kind) and not failed:
            failed.append(kind)
            raise RuntimeError("injected fault")
        return prepare(seqs, num_scheduled, ops, *args)

    runner.prepare = faulty  # type: ignore[method-assign]
    rng = random.Random(0)
    for i in range(4):
        engine.add_request([rng.randrange(1, 128) for _ in range(40)],
                           SamplingParams(max_tokens=60, seed=i, ignore_eos=True), request_id=f"r{i}")
    outputs = {}
    while engine.has_unfinished():
        try:
            outputs |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
        except RuntimeError:
            for seq in list(engine.scheduler.running):
                engine.abort(seq.request_id)
    assert failed == ([] if kind is None else [kind])
    return outputs


@pytest.mark.parametrize("kind", ["swap_out", "swap_in"])
def test_a_step_that_fails_still_applies_its_swaps(tiny_llm: Callable[..., LLM], kind: str) -> None:
    """The scheduler counts on a step's moves once it has scheduled them: a swapped-out sequence
    resumes from its copy, a swapped-in one's slots are freed. A step that fails before its
    forward pass applies them anyway: the swapped survivors' outputs stay right, no slot leaks."""
    config = dict(preemption_mode="swap", host_swap_memory="1MiB", max_num_seqs=4, kv_cache_memory="64KiB")
    reference = run_with_a_failed_step(tiny_llm(**config), None)
    llm = tiny_llm(**config)
    outputs = run_with_a_failed_step(llm, kind)
    assert len(outputs) < len(reference) and all(outputs[r] == reference[r] for r in outputs)
    if kind == "swap_out":  # its victim was swapped, not running, when the step failed
        assert outputs
    assert_tiers_empty(llm)


def test_bad_swap_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(model="random:tiny", preemption_mode="sometimes")
    with pytest.raises(ValueError, match="host_swap_memory"):
        LLM(model="random:tiny", host_swap_memory="lots")
