"""Continuous batching: which sequences run in the next step, and who is preempted.

Invariants the engine relies on:
- Every block move of a step travels in the `SchedulerOutput`: each helper of `schedule()`
  (`_swap_in`, `_make_room_for_decode`, `_admit`) returns the moves the block manager and swap
  space returned to it, joined with `BlockOps.then`, so no move outlives its step; the
  compactions the step's update decided after the forward pass are `carry`-ed into the next.
- Swapped sequences come back before new ones are admitted. When blocks run out, the most
  recently admitted sequence is preempted (by recompute or swap, `prefer_swap`); one that has
  outgrown the device pool offloads its cold blocks instead, since it could never be readmitted.
- The beams of a request are admitted and preempted together; a group that does not fit whole
  gives its grants back (`BlockManager.roll_back`, which also drops their remote loads).
- A sequence runs at most `Sequence.num_runnable` tokens a step and holds blocks for
  `num_slots_to_run` slots (an evicting sequence's chunk ends cap both); `complete_step` is the
  one place `num_computed_tokens` advances for the tokens a sequence holds.
- Speculative decoding (`drafts`): a decoding sequence may run draft tokens after its new one,
  out of the step's token budget, in slots taken after every decode has its own (a draft that
  finds no blocks is dropped, never the cause of a preemption). Drafts are not the sequence's
  tokens: the step's update appends those it accepts and gives back the rest's slots.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from kvserve.cache.block_manager import BlockManager, HostBlock, on_device
from kvserve.cache.block_ops import BlockOps
from kvserve.cache.swap_space import SwapSpace
from kvserve.engine.draft_policy import DraftPolicy
from kvserve.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerOutput:
    seqs: list[Sequence]
    num_scheduled: list[int]  # tokens each sequence runs this step (its whole remainder, or a chunk)
    is_prefill: bool          # no sequence of the step is decoding
    preempted: list[Sequence]
    block_ops: BlockOps       # every block move to apply before the step runs
    drafts: tuple[tuple[int, ...], ...] = ()  # per sequence, the draft tokens it runs last (empty: none drafts)

    def draft_of(self, i: int) -> tuple[int, ...]:
        return self.drafts[i] if self.drafts else ()

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled)


class Scheduler:
    """Two policies. Prefill-first: a step admits waiting sequences if any fit, otherwise decodes
    all running ones. Chunked prefill (`chunked_prefill`, vLLM v1's): one budget of
    `max_num_batched_tokens` per step, spent on every running decode first, then on the rest of
    partly prefilled prompts, then on new admissions, whose prompts may be cut into chunks; a
    long prompt never stalls the running streams.

    `reserve_tokens` makes every admitted sequence take blocks for that many tokens up front
    (the contiguous baseline); `recompute_all` reruns every token each step (the no-cache baseline).
    With a `swap` space, `prefer_swap(num_tokens)` decides per preemption whether a sequence's
    blocks are copied out (and later back) instead of recomputed.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 reserve_tokens: int = 0, recompute_all: bool = False, swap: SwapSpace | None = None,
                 prefer_swap: Callable[[int], bool] = lambda num_tokens: False,
                 chunked_prefill: bool = False, drafts: DraftPolicy | None = None) -> None:
        self.block_manager = block_manager
        self.drafts = drafts
        self.swap = swap
        self.prefer_swap = prefer_swap
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.reserve_tokens = reserve_tokens
        self.recompute_all = recompute_all
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.preemptions: Counter[str] = Counter()  # by mode: "recompute", "swap"
        self._carried = BlockOps()  # moves decided after a step, for the next one (`carry`)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions.values())

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def carry(self, ops: BlockOps) -> None:
        """Moves decided after a step (the compactions of its evictions), sent at the head of the
        next step's: BlockOps' order applies compactions before any move that may reuse a block
        they give back, and nothing writes a page in between."""
        self._carried = self._carried.then(ops)

    def carries(self) -> bool:
        return self._carried.any()

    def take_carried(self) -> BlockOps:
        """The carried moves, for an engine that has no next step to send them in."""
        carried, self._carried = self._carried, BlockOps()
        return carried

    def schedule(self) -> SchedulerOutput:
        """The step's sequences and every block move they need, each move as the block manager
        or swap space returned it to the helper that decided it, after the carried ones."""
        out = self._schedule_chunked() if self.chunked_prefill else self._schedule_whole()
        carried = self.take_carried()  # after: a scheduling error leaves them carried
        return out if not carried.any() else dataclasses.replace(out, block_ops=carried.then(out.block_ops))

    def _schedule_whole(self) -> SchedulerOutput:
        # Swapped sequences hold finished work: they come back before new ones are admitted.
        if not self.swapped:
            admitted, ops = self._admit(self.max_num_batched_tokens, chunked=False)
            if admitted:
                return SchedulerOutput(admitted, [s.num_runnable for s in admitted], True, [], ops)
        ops = self._swap_in()
        preempted, room = self._make_room_for_decode()
        running = [s for s in self.running if not s.awaiting_length_finish]
        if self.recompute_all:
            for seq in running:
                seq.num_computed_tokens = 0
        counts = [s.num_runnable for s in running]
        drafts, grown = self._draft(running, self.max_num_batched_tokens - sum(counts))
        return SchedulerOutput(running, [n + len(d) for n, d in zip(counts, drafts or [()] * len(counts))], False,
                               preempted, ops.then(room).then(grown), drafts)

    def _schedule_chunked(self) -> SchedulerOutput:
        ops = self._swap_in()
        preempted, room = self._make_room_for_decode()
        ops = ops.then(room)
        budget = self.max_num_batched_tokens
        # Decodes first (one token each), then the remainders of partly prefilled prompts.
        decoding, prefilling = [], []
        for seq in self.running:
            new = seq.num_new_tokens
            if new == 1:
                if not seq.awaiting_length_finish:
                    decoding.append(seq)
            elif new > 1:
                prefilling.append(seq)
        # A decoding sequence runs its one new token (an evicting one too): no need to ask each.
        seqs = decoding[:budget]
        budget -= len(seqs)
        drafts, grown = self._draft(seqs, budget)
        ops = ops.then(grown)
        counts = [1 + len(d) for d in drafts] if drafts else [1] * len(seqs)
        budget -= sum(counts) - len(seqs)
        for seq in prefilling:
            take = min(seq.num_runnable, budget)
            if take == 0:
                break
            seqs.append(seq)
            counts.append(take)
            budget -= take
        if budget > 0 and not self.swapped:
            admitted, loads = self._admit(budget, chunked=True)
            ops = ops.then(loads)
            for seq in admitted:
                take = min(seq.num_runnable, budget)
                if take == 0:  # a group member admitted with its fellows; its tokens run next step
                    continue
                seqs.append(seq)
                counts.append(take)
                budget -= take
        if drafts:
            drafts += ((),) * (len(seqs) - len(drafts))
        return SchedulerOutput(seqs, counts, not decoding, preempted, ops, drafts)

    def _draft(self, decoding: list[Sequence], budget: int) -> tuple[tuple[tuple[int, ...], ...], BlockOps]:
        """Each decoding sequence's draft (all empty: `()`), within `budget` tokens, with the slots
        it runs in: taken after every decode holds its own, so a draft never preempts."""
        if self.drafts is None or budget <= 0 or not self.drafts.drafts_in(len(decoding)):
            return (), BlockOps()
        drafts: list[tuple[int, ...]] = []
        copies: list[tuple[int, int]] = []
        for seq in decoding:
            # Not a request whose samples fork when its first token is sampled (a prompt's last
            # token can run as a decode): the fork takes the ordinary path.
            draft = self.drafts.draft(seq, budget) if seq.num_new_tokens == 1 and not seq.num_forks else ()
            if draft:
                grown = self.block_manager.allocate(seq.seq_id, seq.num_slots_to_run + len(draft),
                                                    num_computed=seq.num_computed_tokens)
                if grown is None:
                    draft = ()
                else:
                    copies += grown
                    budget -= len(draft)
            drafts.append(draft)
        return (tuple(drafts) if any(drafts) else ()), BlockOps(copies=tuple(copies))

    def complete_step(self, out: SchedulerOutput) -> list[int]:
        """After the model ran `out`: every scheduled sequence's computed tokens advance (the one
        place they do). Returns the indices of sequences whose every token is now computed, the
        ones that get a next token; a prompt chunk that leaves more to prefill gets none."""
        done = []
        for i, (seq, n) in enumerate(zip(out.seqs, out.num_scheduled)):
            seq.num_computed_tokens += n - len(out.draft_of(i))  # what it accepts of a draft counts later
            if seq.num_computed_tokens == seq.num_tokens:
                done.append(i)
        return done

    def _admit(self, budget: int, chunked: bool) -> tuple[list[Sequence], BlockOps]:
        """Admits waiting sequences while slots, blocks and `budget` allow; with `chunked`, the
        last one admitted may bring only part of its prompt this step (budget > 0 suffices).
        Returns them and the remote-tier loads of their prompts."""
        admitted: list[Sequence] = []
        loads: list[tuple[int, bytes]] = []
        if not self.waiting:  # most decode steps: no need to count the seats
            return admitted, BlockOps()
        slots = self.max_num_seqs - self._seats_taken()
        while self.waiting:
            # The beams of one request run together (a beam step needs all of them), so a group
            # that was preempted comes back all at once or not at all.
            group = self._group_at_head()
            need, seats = sum(s.num_tokens for s in group), sum(1 + s.num_forks for s in group)
            # Readmitted beams may be cut into chunks too: a beam that completes before the others
            # waits for them, recomputing its last token (Forks.step_beams).
            if seats > slots or budget <= 0 or (need > budget and not chunked) or \
                    not self._staging_room(self.max_num_seqs - slots + seats):
                break
            grants = [self.block_manager.allocate_prompt(s.seq_id, s.token_ids, self.reserve_tokens,
                                                         max_cached=self._cacheable(s),
                                                         salt=s.cache_salt,
                                                         prefill_chunk=s.eviction and s.eviction.prefill_chunk)
                      for s in group]
            if any(grant is None for grant in grants):
                self.block_manager.roll_back([(s.seq_id, len(s.token_ids), grant)
                                              for s, grant in zip(group, grants) if grant is not None])
                break
            for seq, grant in zip(group, grants):
                seq.num_computed_tokens = grant.cached
                if seq.num_cached_tokens is None:  # what a preempted one finds again is not the request's
                    seq.num_cached_tokens = grant.cached
                loads += grant.loads
                budget -= seq.num_runnable
                slots -= 1 + seq.num_forks
                seq.first_scheduled_time = seq.first_scheduled_time or time.perf_counter()
                seq.status = SequenceStatus.RUNNING
                self.waiting.popleft()
                self.running.append(seq)
                admitted.append(seq)
        return admitted, BlockOps(loads=tuple(loads))

    def _staging_room(self, seats: int) -> bool:
        """Whether `seats` running sequences fit a compressed pool's staging slots, so a step never
        finds them exhausted (cache/staging_slots.py)."""
        staging = self.block_manager.staging
        return staging is None or staging.room_for(seats, self.max_num_batched_tokens)

    @staticmethod
    def _cacheable(seq: Sequence) -> int | None:
        """The most prompt tokens `seq` may take from the prefix cache (None: any): none when it
        asks for prompt logprobs (every position's logits), less when its eviction policy reads
        what the prompt's queries see."""
        if seq.params.prompt_logprobs is not None:
            return 0
        return None if seq.eviction is None else seq.eviction.cacheable(len(seq.prompt_token_ids))

    def _group_at_head(self) -> list[Sequence]:
        head = self.waiting[0]
        if head.beam is None:
            return [head]
        return list(itertools.takewhile(lambda s: s.beam is head.beam, self.waiting))

    def _make_room_for_decode(self) -> tuple[list[Sequence], BlockOps]:
        """Every running sequence needs a slot for its next token; when blocks run out, the most
        recently admitted sequence (with its fellow beams) is preempted by recompute or swap, and
        a sequence too long to be readmitted offloads cold blocks instead."""
        preempted: list[Sequence] = []
        copies: list[tuple[int, int]] = []
        offloads: list[tuple[int, HostBlock]] = []
        swap_out: list[tuple[int, int, int]] = []
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.awaiting_length_finish:
                i += 1
                continue
            copied = self.block_manager.allocate(seq.seq_id, seq.num_slots_to_run, self.reserve_tokens,
                                                 num_computed=seq.num_computed_tokens - seq.num_evicted)
            if copied is not None:
                if copied:
                    copies += copied
                i += 1
                continue
            # The most recent sequence that could be admitted again; one that has outgrown the
            # device pool never could, so it is not preempted but offloads its cold blocks.
            bm = self.block_manager
            # Not one awaiting its last token (async scheduling): its blocks are about to be freed.
            victim = next((s for s in reversed(self.running) if not s.awaiting_length_finish
                           and bm.blocks_peak(s.num_tokens) <= bm.capacity), seq)
            offload = bm.offload_coldest(seq.seq_id) if victim is seq and seq.beam is None else None
            if offload is not None:
                offloads.append(offload)
                continue
            group = [s for s in self.running if s.beam is victim.beam] if victim.beam else [victim]
            for member in group:
                # A member that ran before `seq` (a beam, or any sequence when those after it have
                # outgrown the pool) may have copied its last block: that block goes back now and
                # a later copy of this step may take it (two copies into one block race in the
                # runner's scatter), and a swap-out, which lands before the copies, would save it
                # unfilled. So its copy is dropped and it is recomputed.
                gone = {b for table in bm.tables_of(member.seq_id) for b in table}
                copied = any(dst in gone for _, dst in copies)
                copies = [c for c in copies if c[1] not in gone]
                self.running.remove(member)
                swap_out += self.preempt(member, swap=not copied)
                preempted.append(member)
            i = 0  # members may have sat before i; allocating again is a no-op for the others
        return preempted, BlockOps(swap_out=tuple(swap_out), offloads=tuple(offloads), copies=tuple(copies))

    def _swap_in(self) -> BlockOps:
        """Bring swapped sequences back while blocks allow, leaving every running sequence room to
        take one more block this step, so none of them is preempted right after. With nothing
        running, the head comes back if it fits at all; one that cannot (its next token needs
        more blocks than are free) drops its copy and waits to be recomputed: left swapped, it
        would wait forever, and with it every waiting sequence."""
        if not self.swapped:  # most steps: no need to count the seats
            return BlockOps()
        bm = self.block_manager
        seats = self._seats_taken()
        requeued: list[Sequence] = []
        swap_in: list[tuple[int, int, int]] = []
        while self.swapped and seats + 1 + self.swapped[0].num_forks <= self.max_num_seqs:
            seq = self.swapped[0]
            headroom = len(self.running) + 1 if self.running else 0
            if bm.blocks_for(seq.num_slots_to_run) + headroom > len(bm.free_blocks):
                if not self.running:
                    self.swap.discard(seq.seq_id)
                    requeued.append(self.swapped.popleft())
                    continue
                break
            # Blocks suffice (checked above), and a new table shares no block to copy.
            copies = bm.allocate(seq.seq_id, seq.num_slots_to_run, salt=seq.cache_salt)
            assert copies == ()
            swap_in += self.swap.swap_in(seq.seq_id, bm.tables[seq.seq_id])
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.swapped.popleft())
            seats += 1 + seq.num_forks
        for seq in reversed(requeued):  # each goes to the head: in reverse, they keep their order
            self._requeue(seq)
        return BlockOps(swap_in=tuple(swap_in))

    def waiting_past_seats(self, extra: Iterable[Sequence] = ()) -> int:
        """Requests of the waiting queue, then of `extra` (as if queued behind it), that the next
        admission leaves waiting for a batch seat, by `_admit`'s rule: in order, a seat per sample
        or beam a sequence forks into, none while a sequence is swapped. Seats only: one given a
        seat may still wait for blocks. A request counts once, however many of its samples or
        beams wait (preemption puts them back one by one)."""
        seats = 0 if self.swapped else self.max_num_seqs - self._seats_taken()
        left: set[str] = set()
        for seq in itertools.chain(self.waiting, extra):
            seats -= 1 + seq.num_forks
            if seats < 0:
                left.add(seq.request_id)
        return len(left)

    def _seats_taken(self) -> int:
        """Running sequences, counting the samples a request with n of them forks after its prefill."""
        return sum(1 + s.num_forks for s in self.running)

    def add_running(self, seq: Sequence) -> None:
        """A sample forked from a running sequence; its blocks are already shared."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def preempt(self, seq: Sequence, swap: bool = True) -> tuple[tuple[int, int, int], ...]:
        """Returns the swap-out copies (device block, tier, slot) of a sequence preempted by swap,
        to run before its blocks are reused; none for one preempted by recompute (always, when
        not `swap`)."""
        seq.num_preemptions += 1
        table = self.block_manager.tables[seq.seq_id]
        # Beams stay on the recompute path: they must come back together (see `_admit`).
        resident = all(map(on_device, table))
        swap_out = self.swap.swap_out(seq.seq_id, table) if (
            swap and self.swap is not None and seq.beam is None and resident
            and self.prefer_swap(seq.num_slots)) else None
        self.block_manager.free(seq.seq_id)
        if swap_out is not None:
            seq.status = SequenceStatus.SWAPPED
            self.preemptions["swap"] += 1
            self.swapped.append(seq)
            return swap_out
        self.preemptions["recompute"] += 1
        self._requeue(seq)
        return ()

    def recompute(self, seq: Sequence) -> None:
        """Preempts running `seq` by recompute between steps, outside scheduling (its blocks go
        back now): an evicting sequence whose due compaction found no blocks replays from its
        prompt, where run on un-evicted it would keep other tokens than it keeps alone."""
        self.running.remove(seq)
        self.preempt(seq, swap=False)

    def recompute_lost(self, out: SchedulerOutput, lost: Collection[str]) -> SchedulerOutput:
        """`out` after its swaps, of which those of the sequences in `lost` failed (their pages are
        gone, SwapSpace.apply): each is recomputed instead, a swapped one requeued, a running
        one (its swap-in failed) preempted and taken out of the step. The step's other moves
        stay: a swapped-in table is new, so none of them is that sequence's."""
        if not lost:
            return out
        for seq in [s for s in self.swapped if s.seq_id in lost]:
            self.swapped.remove(seq)
            self.swap.discard(seq.seq_id)
            self._requeue(seq)
        for seq in [s for s in self.running if s.seq_id in lost]:
            self.recompute(seq)
        kept = [i for i, s in enumerate(out.seqs) if s.seq_id not in lost]
        return dataclasses.replace(out, seqs=[out.seqs[i] for i in kept],
                                   num_scheduled=[out.num_scheduled[i] for i in kept],
                                   drafts=tuple(out.drafts[i] for i in kept) if out.drafts else ())

    def _requeue(self, seq: Sequence) -> None:
        """Back to the head of the queue, to be recomputed in full (then evicted again by its policy)."""
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.kv_state = None
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a sequence wherever it is (running, waiting, or already gone)."""
        self.block_manager.free(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.swap.discard(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
