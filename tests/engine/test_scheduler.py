"""Scheduler without a model: admission limits, prefill/decode steps, preemption, finish.

A model step is simulated the way the engine does it: after schedule(), the scheduled tokens
count as computed and each sequence they complete gets one new output token.
"""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable
from typing import Any

import torch

from kvserve.cache.block_manager import BlockManager, PromptGrant
from kvserve.cache.block_ops import BlockOps
from kvserve.cache.compaction import Compaction
from kvserve.engine.beam_search import BeamGroup
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.engine.sequence import OutputState, Sequence, SequenceStatus
from kvserve.sampling_params import SamplingParams


class ReadOnlyOutput(OutputState):
    """The output side's state of a sequence, which the scheduler never writes: every test here
    that drives the scheduler fails if it does."""
    sealed = False

    def __setattr__(self, name: str, value: object) -> None:
        if self.sealed:
            raise AssertionError(f"the scheduler wrote OutputState.{name}")
        super().__setattr__(name, value)


def make_seq(request_id: str, prompt_len: int) -> Sequence:
    out = ReadOnlyOutput()
    object.__setattr__(out, "sealed", True)
    return Sequence(request_id, list(range(prompt_len)), SamplingParams(), seed=0, out=out)


def run_model(sched: Scheduler, out: SchedulerOutput) -> None:
    """What the engine does after a forward pass: one sampled token per sequence whose
    scheduled tokens completed it (all of them, without chunked prefill)."""
    for i in sched.complete_step(out):
        out.seqs[i].output_token_ids.append(7)


def ids(seqs: Iterable[Sequence]) -> list[str]:
    return [s.request_id for s in seqs]


def check_blocks(sched: Scheduler) -> None:
    """Running sequences own enough blocks for their tokens, waiting ones own none, and no block
    is shared or lost (brute force over the tables)."""
    bm = sched.block_manager
    for seq in sched.running:
        assert len(bm.tables[seq.request_id]) * bm.block_size >= seq.num_tokens - 1
    for seq in sched.waiting:
        assert seq.request_id not in bm.tables
    assert set(bm.tables) <= {s.request_id for s in sched.running}
    used = [b for t in bm.tables.values() for b in t]
    assert sorted(used + list(bm.free_blocks)) == list(range(bm.num_blocks))


def test_admits_in_order_up_to_max_num_seqs() -> None:
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=1000)
    seqs = [make_seq(f"r{i}", 3) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert out.is_prefill and ids(out.seqs) == ["r0", "r1"] and out.preempted == []
    assert all(s.status is SequenceStatus.RUNNING and s.num_computed_tokens == 0 for s in out.seqs)
    assert ids(sched.waiting) == ["r2"] and seqs[2].status is SequenceStatus.WAITING
    run_model(sched, out)
    # Full: the next step decodes the two running sequences; r2 keeps waiting.
    out = sched.schedule()
    assert not out.is_prefill and ids(out.seqs) == ["r0", "r1"]
    assert ids(sched.waiting) == ["r2"]
    check_blocks(sched)


def test_admission_stops_at_batched_token_budget() -> None:
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=10, max_num_batched_tokens=12)
    for i in range(3):
        sched.add(make_seq(f"r{i}", 5))
    out = sched.schedule()
    assert out.is_prefill and ids(out.seqs) == ["r0", "r1"]  # 5 + 5 = 10; a third 5 exceeds 12
    run_model(sched, out)
    # The next step is again a prefill (prefill first), admitting only the one still waiting.
    out = sched.schedule()
    assert out.is_prefill and ids(out.seqs) == ["r2"]
    run_model(sched, out)
    out = sched.schedule()
    assert not out.is_prefill and ids(out.seqs) == ["r0", "r1", "r2"]
    # Each has had one token sampled, so the decode step runs exactly one new token each.
    assert [s.num_new_tokens for s in out.seqs] == [1, 1, 1]


def test_admission_stops_when_blocks_run_out_and_keeps_fifo() -> None:
    # 3 blocks of 4: r0 (8 tokens) takes 2, r1 (8 tokens) does not fit. r2 (1 token) would fit,
    # but admission is in order, so it is not let past r1.
    bm = BlockManager(3, 4)
    sched = Scheduler(bm, max_num_seqs=10, max_num_batched_tokens=1000)
    for name, n in [("r0", 8), ("r1", 8), ("r2", 1)]:
        sched.add(make_seq(name, n))
    out = sched.schedule()
    assert out.is_prefill and ids(out.seqs) == ["r0"]
    assert ids(sched.waiting) == ["r1", "r2"]
    assert set(bm.tables) == {"r0"} and len(bm.free_blocks) == 1  # the failed try left nothing
    run_model(sched, out)
    out = sched.schedule()
    assert not out.is_prefill and ids(out.seqs) == ["r0"]
    check_blocks(sched)


def test_decode_preempts_most_recent_sequence() -> None:
    # 4 blocks of 4. Three 4-token prompts take one block each; after one token each, every
    # sequence needs a second block at the next decode but only one is free.
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=10, max_num_batched_tokens=1000)
    a, b, c, d = make_seq("a", 4), make_seq("b", 4), make_seq("c", 4), make_seq("d", 9)
    for s in (a, b, c, d):
        sched.add(s)
    out = sched.schedule()
    assert ids(out.seqs) == ["a", "b", "c"]  # d (3 blocks) does not fit
    run_model(sched, out)
    c_blocks = list(bm.tables["c"])

    out = sched.schedule()
    # a takes the free block, b finds none, so c (admitted last) is preempted and b gets c's block.
    assert not out.is_prefill
    assert ids(out.seqs) == ["a", "b"] and ids(out.preempted) == ["c"]
    assert ids(sched.running) == ["a", "b"]
    assert "c" not in bm.tables and "c" not in bm.num_tokens
    assert len(bm.tables["a"]) == 2 and len(bm.tables["b"]) == 2
    assert set(bm.tables["b"]) & set(c_blocks)  # c's freed block went to b
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0
    assert c.output_token_ids == [7]            # its token is kept and recomputed later
    assert ids(sched.waiting) == ["c", "d"]     # put first, ahead of older waiting d
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert a.num_preemptions == 0 and b.num_preemptions == 0
    check_blocks(sched)

    # After a and b finish, c is readmitted and recomputes its prompt plus its kept token.
    run_model(sched, out)
    sched.finish(a)
    sched.finish(b)
    out = sched.schedule()
    assert out.is_prefill and ids(out.seqs) == ["c"]
    assert c.num_new_tokens == 5


def test_preempts_itself_when_last_and_short() -> None:
    # Two blocks of 2: a (2 tokens) and b (2 tokens) fill the pool. At decode a needs a block:
    # b is preempted; then a runs alone. When a outgrows the whole pool it is the only (and so
    # most recent) running sequence and preempts itself rather than looping forever.
    bm = BlockManager(2, 2)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = make_seq("a", 2), make_seq("b", 2)
    sched.add(a)
    sched.add(b)
    run_model(sched, sched.schedule())
    out = sched.schedule()
    assert ids(out.seqs) == ["a"] and ids(out.preempted) == ["b"]
    run_model(sched, out)                     # a: 4 tokens, fits in 2 blocks
    out = sched.schedule()
    assert ids(out.seqs) == ["a"] and out.preempted == []
    run_model(sched, out)                     # a: 5 tokens, needs a 3rd block
    out = sched.schedule()
    assert out.seqs == [] and ids(out.preempted) == ["a"]
    assert ids(sched.waiting) == ["a", "b"] and bm.tables == {}
    assert len(bm.free_blocks) == 2


def test_recompute_all_resets_every_decode() -> None:
    sched = Scheduler(BlockManager(50, 4), max_num_seqs=4, max_num_batched_tokens=1000,
                      recompute_all=True)
    a, b = make_seq("a", 3), make_seq("b", 6)
    sched.add(a)
    sched.add(b)
    run_model(sched, sched.schedule())
    for step in range(1, 5):
        out = sched.schedule()
        assert not out.is_prefill
        # The whole sequence (prompt + outputs so far) runs again each step.
        assert [s.num_computed_tokens for s in out.seqs] == [0, 0]
        assert [s.num_new_tokens for s in out.seqs] == [3 + step, 6 + step]
        run_model(sched, out)


def test_reserve_tokens_takes_blocks_up_front() -> None:
    bm = BlockManager(10, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=1000, reserve_tokens=16)
    for name in ("a", "b", "c"):
        sched.add(make_seq(name, 2))
    out = sched.schedule()
    # Each reservation is 16 tokens = 4 blocks, so only two of the three fit in 10 blocks.
    assert ids(out.seqs) == ["a", "b"]
    assert [len(bm.tables[n]) for n in ("a", "b")] == [4, 4] and len(bm.free_blocks) == 2
    run_model(sched, out)
    run_model(sched, sched.schedule())
    assert [len(bm.tables[n]) for n in ("a", "b")] == [4, 4]  # growth stays inside the reservation


def test_finish_frees_blocks_wherever_the_sequence_is() -> None:
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=1000)
    a, b = make_seq("a", 10), make_seq("b", 2)
    sched.add(a)
    sched.add(b)
    run_model(sched, sched.schedule())
    assert len(bm.free_blocks) == 1
    sched.finish(a)
    assert len(bm.free_blocks) == 4 and "a" not in bm.tables
    assert a.status is SequenceStatus.FINISHED and a.finished and a not in sched.running
    sched.finish(b)  # still waiting
    assert not sched.waiting and b.status is SequenceStatus.FINISHED
    assert not sched.has_unfinished()
    sched.finish(a)  # twice: harmless
    assert len(bm.free_blocks) == 4


def test_random_workload_completes_with_invariants() -> None:
    # A seeded stream of requests with small pools: each step the block ownership is checked by
    # brute force, each sequence finishes after its max_tokens, and every block comes back.
    rng = random.Random(7)
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=40)
    want: dict[str, int] = {}
    pending: list[Sequence] = []
    for i in range(20):
        seq = make_seq(f"r{i}", rng.randint(1, 12))
        want[seq.request_id] = rng.randint(1, 10)
        pending.append(seq)
    done: list[str] = []
    for _ in range(2000):
        if pending and rng.random() < 0.8:
            sched.add(pending.pop(0))
        if not sched.has_unfinished() and not pending:
            break
        out = sched.schedule()
        if out.is_prefill:
            assert sum(s.num_tokens for s in out.seqs) <= 40
        assert len(sched.running) <= 4
        run_model(sched, out)
        check_blocks(sched)
        for seq in list(out.seqs):
            if len(seq.output_token_ids) >= want[seq.request_id]:
                sched.finish(seq)
                done.append(seq.request_id)
    assert sorted(done) == sorted(want) and len(done) == len(set(done))
    assert sched.num_preemptions > 0  # the pool was small enough to exercise preemption
    assert sorted(bm.free_blocks) == list(range(8)) and bm.tables == {}


def chunked(bm: BlockManager, max_num_seqs: int, budget: int) -> Scheduler:
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, chunked_prefill=True)


def test_chunked_prefill_splits_a_long_prompt_and_keeps_decoding() -> None:
    sched = chunked(BlockManager(100, 4), max_num_seqs=4, budget=8)
    a, b = make_seq("a", 3), make_seq("long", 20)
    sched.add(a)
    out = sched.schedule()
    assert ids(out.seqs) == ["a"] and out.num_scheduled == [3]
    run_model(sched, out)
    sched.add(b)
    # Each step: a's decode token first, then 7 tokens of b's 20-token prompt, until it is done.
    for step, chunk in enumerate([7, 7, 6]):
        out = sched.schedule()
        assert ids(out.seqs) == ["a", "long"] and out.num_scheduled == [1, chunk], step
        assert out.num_tokens <= 8 and not out.is_prefill
        before = len(a.output_token_ids), len(b.output_token_ids)
        run_model(sched, out)
        assert len(a.output_token_ids) == before[0] + 1  # a decoded in every step with a chunk
        assert len(b.output_token_ids) == (1 if step == 2 else 0)  # b's token only once its prompt is in
        check_blocks(sched)
    out = sched.schedule()
    assert out.num_scheduled == [1, 1]


def test_chunked_prefill_budget_goes_to_decodes_before_new_prompts() -> None:
    sched = chunked(BlockManager(200, 4), max_num_seqs=8, budget=6)
    for i in range(4):
        sched.add(make_seq(f"d{i}", 1))
    run_model(sched, sched.schedule())  # four 1-token prompts, 4 of the 6 tokens
    sched.add(make_seq("p", 30))
    out = sched.schedule()
    assert ids(out.seqs) == ["d0", "d1", "d2", "d3", "p"] and out.num_scheduled == [1, 1, 1, 1, 2]


class ServingRemoteTier:
    """A remote KV tier that holds every block asked for (its pages: its hash), as a warm Redis."""

    def __init__(self) -> None:
        self.fetched: list[bytes] = []

    def fetch(self, hashes: list[bytes]) -> list[bytes]:
        self.fetched += hashes
        return [b"pages of " + h for h in hashes]


def test_a_rolled_back_group_drops_its_remote_loads_and_their_cache_entries() -> None:
    """A beam group whose first member got blocks from the remote tier and whose second did not
    fit gives the blocks back: a decode in the same step takes one of them, so no load may land
    there, and no cache entry may name a block whose pages never came. Once the group fits, its
    members' loads go into the step that admits it."""
    remote = ServingRemoteTier()
    bm = BlockManager(num_blocks=6, block_size=4, remote=remote)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=1000)
    runner = make_seq("r", 4)
    sched.add(runner)
    run_model(sched, sched.schedule())  # one block; its next token needs a second
    beam = BeamGroup(width=2, length_penalty=1.0, early_stopping=False, max_tokens=4, eos_token_id=None)
    first = Sequence("g", list(range(100, 109)), SamplingParams(), seed=0, beam=beam)  # 2 remote blocks + 1
    second = Sequence("g", list(range(200, 209)), SamplingParams(), seed=0, beam=beam, index=1)
    sched.add(first)
    sched.add(second)
    grants: list[PromptGrant | None] = []
    allocate_prompt = bm.allocate_prompt

    def recording(*args: Any, **kwargs: Any) -> PromptGrant | None:
        grants.append(allocate_prompt(*args, **kwargs))
        return grants[-1]

    bm.allocate_prompt = recording
    before = dataclasses.replace(bm.prefix_stats)
    out = sched.schedule()  # first takes 3 of the 5 free blocks, second cannot take 3 more
    assert bm.prefix_stats == before  # a group that did not fit is not counted (it was, then again)
    assert len(remote.fetched) == 2 and ids(out.seqs) == ["r"] and grants[1] is None
    assert bm.tables["r"][1] in [b for b, _ in grants[0].loads]  # the decode took a block to be loaded
    assert out.block_ops.loads == ()
    assert not any(h in bm.cache for h in remote.fetched)
    assert list(sched.waiting) == [first, second] and first.seq_id not in bm.tables
    check_blocks(sched)
    run_model(sched, out)
    sched.finish(runner)
    out = sched.schedule()
    assert out.seqs == [first, second]
    assert [b for b, _ in out.block_ops.loads] == bm.tables[first.seq_id][:2] + bm.tables[second.seq_id][:2]
    assert [p for _, p in out.block_ops.loads] == [b"pages of " + h for h in remote.fetched[2:]]
    assert first.num_computed_tokens == second.num_computed_tokens == 8
    stats = bm.prefix_stats
    assert (stats.prompt_tokens - before.prompt_tokens, stats.cached_tokens - before.cached_tokens,
            stats.remote_tokens - before.remote_tokens) == (18, 16, 16)


def test_waiting_past_seats_follows_the_admission_rule() -> None:
    """Counted by hand: 4 seats, one taken by a running sequence, a request of n=2 takes 2."""
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=1000)
    sched.add(make_seq("run", 4))
    run_model(sched, sched.schedule())
    pair = Sequence("pair", [1, 2, 3], SamplingParams(n=2), seed=0, num_forks=1)
    sched.add(pair)
    assert sched.waiting_past_seats() == 0  # 3 free seats, the pair takes 2
    assert sched.waiting_past_seats([make_seq("a", 4)]) == 0  # the last seat
    assert sched.waiting_past_seats([make_seq("a", 4), make_seq("b", 4), make_seq("c", 4)]) == 2
    # While a sequence is swapped nothing is admitted: every waiting request waits (the server
    # used to count the swapped one's seats free and take a burst past --max-waiting).
    swapped = make_seq("s", 4)
    swapped.status = SequenceStatus.SWAPPED
    sched.swapped.append(swapped)
    assert sched.waiting_past_seats([make_seq("a", 4)]) == 2


def test_carried_compactions_lead_the_next_steps_moves_once() -> None:
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=16, chunked_prefill=True)
    seq = make_seq("r", 6)
    sched.add(seq)
    run_model(sched, sched.schedule())
    compaction = Compaction((), torch.tensor([0]), torch.tensor([0]), torch.tensor([5]), torch.tensor([1]))
    sched.carry(BlockOps(compactions=(compaction,)))
    assert sched.carries()
    sched.add(make_seq("s", 9))  # an admission that takes blocks the compaction's sequence gave back
    out = sched.schedule()
    assert out.block_ops.compactions == (compaction,) and not sched.carries()
    assert sched.schedule().block_ops.compactions == ()


def test_drafts_come_out_of_the_token_budget_and_never_preempt() -> None:
    """A decoding sequence runs its draft after its token: counted against the budget, in slots
    taken after every decode holds its own (blocks short: the draft is dropped, nobody is
    preempted); a batch at the size limit drafts nothing."""
    from kvserve.engine.draft_policy import DraftPolicy
    from kvserve.engine.ngram_proposer import NgramProposer
    from kvserve.engine.spec_state import SpecState

    def decoding(budget: int, num_blocks: int, limit: int = 8, n: int = 1) -> tuple[Scheduler, SchedulerOutput]:
        bm = BlockManager(num_blocks, 4)
        sched = Scheduler(bm, 4, budget, chunked_prefill=True,
                          drafts=DraftPolicy(NgramProposer(3, 1, 2), limit, max_model_len=64))
        for i in range(n):
            sched.add(Sequence(f"s{i}", [1, 2, 3, 1, 2, 3, 1], SamplingParams(max_tokens=20), seed=0,
                               spec=SpecState()))
        while not all(s.output_token_ids for s in sched.running) or sched.waiting:  # the prompts, in chunks
            prompts = sched.schedule()
            for i in sched.complete_step(prompts):
                prompts.seqs[i].output_token_ids.append(2)  # [1, 2] recurs: it was followed by [3, 1, 2]
        return sched, sched.schedule()

    sched, out = decoding(budget=16, num_blocks=8)
    assert out.drafts == ((3, 1, 2),) and out.num_scheduled == [4]
    assert sched.block_manager.num_tokens["s0"] == 8 + 3
    sched, out = decoding(budget=3, num_blocks=8)
    assert out.drafts == ((3, 1),) and out.num_scheduled == [3]
    sched, out = decoding(budget=16, num_blocks=2)  # 2 blocks: the token fits, its draft does not
    assert out.drafts == () and out.num_scheduled == [1] and not out.preempted
    sched, out = decoding(budget=16, num_blocks=16, limit=2, n=2)
    assert out.drafts == () and out.num_scheduled == [1, 1]


def test_a_preempted_sequences_copy_on_write_is_dropped() -> None:
    """A beam copies its shared last block, then a later decode finds no block and the beam's
    group (the most recent) is preempted: the copy's destination goes back and a later copy-on-write
    of the same step takes it. Two copies into one block would race in `k[dst] = k[src]` (index_put
    with repeated indices is undefined), so only live sequences' copies remain, each into a block
    its sequence holds."""
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=1000)
    beam = BeamGroup(width=2, length_penalty=1.0, early_stopping=False, max_tokens=8, eos_token_id=None)
    m, y, p, r = (Sequence(name, list(range(start, start + n)), SamplingParams(), seed=0,
                           beam=beam if name == "m" else None)
                  for name, start, n in (("m", 100, 5), ("y", 200, 4), ("p", 300, 5), ("r", 400, 5)))
    for seq in (m, y, p, r):
        sched.add(seq)
    run_model(sched, sched.schedule())
    # Each of p, r and m forks a sample sharing its partial last block; m's is a beam, last to run.
    for parent in (p, r, m):
        child = Sequence(parent.request_id, parent.token_ids[:5], SamplingParams(), seed=0,
                         beam=parent.beam, index=1)
        bm.fork(parent.seq_id, child.seq_id)
        child.output_token_ids.append(7)
        child.num_computed_tokens = parent.num_computed_tokens
        sched.add_running(child)
    assert len(bm.free_blocks) == 1
    out = sched.schedule()  # m copies into the free block, y finds none, m's group goes
    assert ids(out.preempted) == ["m", "m"]
    copies = out.block_ops.copies
    destinations = [dst for _, dst in copies]
    assert len(set(destinations)) == len(destinations), copies
    # Every copy writes the last block of a running sequence, from the block its sibling still holds.
    running = {s.seq_id: bm.tables[s.seq_id] for s in sched.running}
    assert sorted(destinations) == sorted(running[s][-1] for s in ("p", "r"))
    assert sorted(src for src, _ in copies) == sorted(running[s][-1] for s in ("p#1", "r#1"))

