"""The block manager's staging slots: a step's plan worked by hand, slots given back, and
admission that refuses a sequence the slots cannot hold instead of failing a step."""
from __future__ import annotations

from kvserve.cache.block_manager import BlockManager
from kvserve.cache.staging_slots import StagingPlan
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.sequence import Sequence
from kvserve.sampling_params import SamplingParams


def test_a_prompt_plan_worked_by_hand() -> None:
    bm = BlockManager(16, 16, enable_prefix_caching=False, staging_slots=9, residual=16)
    staging = bm.staging
    assert bm.allocate_prompt("a", list(range(40))) is not None
    table = bm.tables["a"]
    plan = staging.plan([(table, 0, 40)], ())
    # Slots are taken 0, 1, 2 in block order; each row is (token offset, staging position, count).
    assert plan.staged == ((0, 0, 16), (16, 16, 16), (32, 32, 8))
    # The window is the last 16 tokens (24..39): the first block left it and is sealed from slot 0,
    # which this step still reads from staging and the next step may reuse.
    assert plan.seals == ((table[0], 0),)
    assert dict(plan.reads) == {table[0]: 0, table[1]: 1, table[2]: 2}
    assert staging.stage_of == {table[1]: 1, table[2]: 2} and staging.num_free == 7
    # One decode token (40): the window 25..40 still touches block 1, so nothing is sealed.
    bm.allocate("a", 41)
    assert staging.plan([(table, 40, 41)], ()) == \
        StagingPlan(((0, 2 * 16 + 8, 1),), (), ((table[1], 1), (table[2], 2)), ())
    # Seven more (41..47): the window 32..47 leaves block 1 behind.
    bm.allocate("a", 48)
    plan = staging.plan([(table, 41, 48)], ())
    assert plan.staged == ((0, 2 * 16 + 9, 7),) and plan.seals == ((table[1], 1),)
    bm.free("a")
    assert staging.release_unowned() == () and staging.num_free == 9  # nothing cached: no seal


def test_admission_stops_where_the_staging_slots_would_run_out() -> None:
    # Residual 32 in blocks of 16: a running sequence holds up to 2 window blocks + a partial
    # one + a copy-on-write copy = 4 slots, and a step of 16 tokens touches 1 block more.
    bm = BlockManager(64, 16, staging_slots=9, residual=32)
    assert bm.staging.per_sequence() == 4
    assert bm.staging.room_for(2, 16) and not bm.staging.room_for(3, 16)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, chunked_prefill=True)
    for i in range(4):
        sched.add(Sequence(f"r{i}", [1, 2], SamplingParams(), seed=0))
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["r0", "r1"] and len(sched.waiting) == 2
    # Unstaged, the same scheduler admits all four.
    sched = Scheduler(BlockManager(64, 16), max_num_seqs=4, max_num_batched_tokens=16, chunked_prefill=True)
    for i in range(4):
        sched.add(Sequence(f"r{i}", [1, 2], SamplingParams(), seed=0))
    assert len(sched.schedule().seqs) == 4
