"""Property-based tests of the BlockManager: random admit / decode / fork / free interleavings
checked against a shadow model of every sequence's tokens and of the KV pool's slots.

The pool is simulated as block_id -> list of token ids "written" into each slot. A write happens
only where the engine's forward would write (prefill after `allocate_prompt`, one token after
`allocate`), always after the pending copy-on-write copies are applied, as the model runner does.
Reading every sequence's block table slot by slot through that simulated pool must give back the
sequence's own tokens: this is what shows that prefix-cache hits and copy-on-write are correct.

Token eviction (`compact`) drops slots of a sequence: the shadow then tracks which position each
slot holds, and reading the table must give back the tokens at those positions. A compaction
waits for the next apply, where it goes before every other move, as in `BlockOps`; the engine
applies it sooner, right after the step that decided it, which is one of the orders drawn here.

Preemption by swap runs the real `SwapSpace` over a real (tiny) `KVPool`: every write and every
copy is mirrored into the pool's K tensor (the token id as a float), and the machine keeps a shadow
of the tiers' slots, updated in the order the swaps were recorded. After every step the real pool
and tiers must hold what the shadows hold, so a swapped-out sequence read back through its new
block table after swap-out / apply / swap-in / apply gives back its tokens, from host or disk.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
import torch

from kvserve.cache.block_manager import BlockManager
from kvserve.cache.compaction import Compaction
from kvserve.cache.kv_pool import KVPool
from kvserve.cache.swap_space import DiskTier, SwapSpace

Pool = dict[int, list[int | None]]
TierPool = dict[tuple[int, int], list[int | None]]  # (tier index, slot) -> token ids
# A swap recorded but not applied yet, in record order:
#   ("out", device block, tier, slot) or ("in", tier, slot, device block)
SwapOp = tuple[str, int, int, int]

# A few fixed prefixes over a tiny alphabet, so that shared prefixes (and so cache hits,
# shared blocks and copy-on-write) are frequent, plus suffixes from the same alphabet.
PREFIXES: list[list[int]] = [
    [],
    [1, 2, 3, 1, 2, 3, 1, 2],
    [1, 2, 3, 1, 0, 0, 0, 0],
    [3, 3, 3, 3, 3, 3],
]
ALPHABET = st.integers(0, 3)


@dataclass
class ShadowSeq:
    """What the engine knows of a sequence: its tokens and how many of them are in the pool."""
    tokens: list[int]
    written: int  # positions [0, written) are computed (their K/V in the pool unless evicted)
    registered: int = 0  # the num_computed last passed to register_full_blocks
    held: list[int] | None = None  # after an eviction: the position each slot holds

    def positions(self) -> list[int]:
        """The position each slot holds, slot by slot."""
        return list(range(self.written)) if self.held is None else self.held

    @property
    def evicted(self) -> int:
        return self.written - len(self.positions())


@dataclass
class Model:
    seqs: dict[str, ShadowSeq] = field(default_factory=dict)
    pool: Pool = field(default_factory=dict)
    # The real pool and swap space the shadows above and below are mirrored into.
    kv: KVPool | None = None
    swap: SwapSpace | None = None
    swapped: dict[str, ShadowSeq] = field(default_factory=dict)  # preempted by swap
    tiers: TierPool = field(default_factory=dict)
    pending_swaps: list[SwapOp] = field(default_factory=list)
    swapped_in: set[str] = field(default_factory=set)  # swapped in since the last apply
    # The moves the manager and swap space returned since the last apply, as the scheduler
    # gathers a step's (the engine hands its compactions to the runner the same way).
    compactions: list[Compaction] = field(default_factory=list)
    swap_out: list[tuple[int, int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)


def with_copies(pool: Pool, copies: list[tuple[int, int]], block_size: int) -> Pool:
    """The pool as it is after `KVPool.copy_blocks(copies)`: `k[dst] = k[src]` gathers every src
    first, then scatters, so all sources are read before any destination is written (and two
    copies into one block would race, so there are none). A source nobody wrote yet (say, a
    reserved block) copies as empty slots."""
    assert len({dst for _, dst in copies}) == len(copies), f"two copies into one block: {copies}"
    gathered = [(dst, list(pool.get(src, [None] * block_size))) for src, dst in copies]
    out = {b: list(slots) for b, slots in pool.items()}
    for dst, slots in gathered:
        out[dst] = slots
    return out


def with_swaps(pool: Pool, tiers: TierPool, ops: list[SwapOp], block_size: int) -> tuple[Pool, TierPool]:
    """The pool and tiers as they should be once the recorded swaps land, in record order: a
    swap-out reads its block as it is then, a swap-in writes its block."""
    pool = {b: list(slots) for b, slots in pool.items()}
    tiers = {k: list(slots) for k, slots in tiers.items()}
    for op in ops:
        if op[0] == "out":
            _, block, tier, slot = op
            tiers[(tier, slot)] = list(pool.get(block, [None] * block_size))
        else:
            _, tier, slot, block = op
            pool[block] = list(tiers.get((tier, slot), [None] * block_size))
    return pool, tiers


def with_compactions(pool: Pool, compactions: list[Compaction], block_size: int) -> Pool:
    """The pool after `KVPool.compact`: per compaction its copies, then its slot moves (every
    source read before any destination is written)."""
    for c in compactions:
        pool = with_copies(pool, list(c.copies), block_size)
        moved = [pool.get(s // block_size, [None] * block_size)[s % block_size] for s in c.src.tolist()]
        pool = {b: list(slots) for b, slots in pool.items()}
        for d, token in zip(c.dst.tolist(), moved):
            pool.setdefault(d // block_size, [None] * block_size)[d % block_size] = token
    return pool


def apply_copies(bm: BlockManager, model: Model) -> None:
    """What ModelRunner.apply does with a step's block moves: the compactions, the swaps, then
    the copy-on-write copies (the shadows and the real pool alike)."""
    model.pool = with_compactions(model.pool, model.compactions, bm.block_size)
    if model.kv is not None:
        model.kv.compact(tuple(model.compactions))
    if model.swap is not None:
        model.pool, model.tiers = with_swaps(model.pool, model.tiers, model.pending_swaps, bm.block_size)
        model.swap.apply(model.kv, model.swap_out, model.swap_in)
    model.pending_swaps.clear()
    model.swapped_in.clear()
    model.pool = with_copies(model.pool, model.copies, bm.block_size)
    if model.kv is not None:
        model.kv.copy_blocks(model.copies)
    model.compactions, model.swap_out, model.swap_in, model.copies = [], [], [], []


def write(bm: BlockManager, model: Model, seq_id: str, start: int, end: int) -> None:
    """The forward pass writes `seq_id`'s tokens [start, end) into its blocks' slots.

    A write must land in a block this sequence alone owns (else it would change a sibling's or a
    cached prefix's K/V) and that is not in the prefix cache (whose contents must stay fixed)."""
    assert not model.copies and not model.compactions, "moves must be applied before the forward writes"
    seq = model.seqs[seq_id]
    table = bm.tables[seq_id]
    bs = bm.block_size
    evicted = seq.evicted
    for pos in range(start, end):
        slot = pos - evicted  # a new token goes after the slots kept
        block_id = table[slot // bs]
        block = bm.blocks[block_id]
        assert block.ref_count == 1, (
            f"{seq_id} writes position {pos} into block {block_id} with ref_count {block.ref_count}")
        assert block.hash is None, f"{seq_id} writes position {pos} into cached block {block_id}"
        slots = model.pool.setdefault(block_id, [None] * bs)
        slots[slot % bs] = seq.tokens[pos]
        if model.kv is not None:
            model.kv.layers[0][0][block_id, slot % bs, 0, 0] = float(seq.tokens[pos])
    if seq.held is not None:
        seq.held += list(range(max(seq.written, start), end))
    seq.written = max(seq.written, end)


def read(bm: BlockManager, pool: Pool, seq_id: str, n: int) -> list[int | None]:
    """The first n tokens as attention would read them through `seq_id`'s block table."""
    bs = bm.block_size
    table = bm.tables[seq_id]
    return [pool.get(table[pos // bs], [None] * bs)[pos % bs] for pos in range(n)]


def check_invariants(bm: BlockManager, model: Model) -> None:
    """Every structural invariant of the manager, plus contents through the simulated pool."""
    free = bm.free_blocks
    free_set = set(free)
    assert len(free) == len(free_set), "a block is on the free list twice"
    refs = Counter(b for table in bm.tables.values() for b in table)
    for block in bm.blocks:
        # ref_count is exactly the number of table entries naming the block ...
        assert block.ref_count == refs.get(block.block_id, 0), (
            f"block {block.block_id}: ref_count {block.ref_count}, "
            f"{refs.get(block.block_id, 0)} table entries")
        # ... and a block is free exactly when nobody owns it.
        assert (block.block_id in free_set) == (block.ref_count == 0), (
            f"block {block.block_id}: ref_count {block.ref_count}, free={block.block_id in free_set}")
    usage = bm.usage()
    assert usage.free + usage.used + usage.cached == usage.total == bm.num_blocks
    assert usage.used == len(refs)
    assert bm.peak_used >= usage.used
    assert usage.cached == sum(bm.blocks[b].hash is not None for b in free)
    assert set(bm.tables) == set(bm.num_tokens) == set(model.seqs)
    # The contents once the pending swaps and copies land (the next forward applies them, in
    # that order, before reading).
    compacted = with_compactions(model.pool, model.compactions, bm.block_size)
    swapped_pool, tiers_view = with_swaps(compacted, model.tiers, model.pending_swaps, bm.block_size)
    view = with_copies(swapped_pool, model.copies, bm.block_size)
    for key, block_id in bm.cache.items():
        block = bm.blocks[block_id]
        assert block.hash == key, f"cache entry for block {block_id} has a different hash"
        assert len(block.token_ids) == bm.block_size
        # A cached block holds exactly the tokens it is cached under: a hit reads these.
        assert view.get(block_id) == list(block.token_ids), (
            f"cached block {block_id} holds {view.get(block_id)}, cached as {block.token_ids}")
    for block in bm.blocks:
        if block.hash is not None:
            assert bm.cache.get(block.hash) == block.block_id, f"block {block.block_id} hash not in cache"
            assert len(block.token_ids) == bm.block_size
    for seq_id, seq in model.seqs.items():
        assert bm.num_tokens[seq_id] <= len(bm.tables[seq_id]) * bm.block_size
        held = seq.positions()
        want = [seq.tokens[p] for p in held]
        assert read(bm, view, seq_id, len(held)) == want, (
            f"{seq_id} reads {read(bm, view, seq_id, len(held))}, its tokens at {held} are {want}")
    if model.kv is not None:
        # The real pool holds what the shadow says (where the shadow knows a token).
        k = model.kv.layers[0][0][:, :, 0, 0].tolist()
        for block_id, slots in model.pool.items():
            for i, token in enumerate(slots):
                assert token is None or k[block_id][i] == token, (
                    f"pool block {block_id} slot {i} holds {k[block_id][i]}, the shadow {token}")
    if model.swap is not None:
        check_swap_invariants(bm, model, tiers_view)


def check_swap_invariants(bm: BlockManager, model: Model, tiers_view: TierPool) -> None:
    """Slot accounting per tier, swapped sequences' contents in the tiers, and the real pool and
    tiers holding what the shadows hold."""
    swap, bs = model.swap, bm.block_size
    assert swap is not None and model.kv is not None
    assert set(swap.swapped) == set(model.swapped)
    for seq_id in model.swapped:
        assert seq_id not in bm.tables and seq_id not in bm.num_tokens, f"swapped {seq_id} has a block table"
        assert seq_id not in model.seqs
    held = [ts for slots in swap.swapped.values() for ts in slots]
    pending_in = [(t, s) for t, s, _ in model.swap_in]
    assert len(set(held + pending_in)) == len(held) + len(pending_in), "a tier slot is held twice"
    usage = {u.name: u for u in swap.usage()}
    for index, tier in enumerate(swap.tiers):
        assert len(tier.free) == len(set(tier.free)), f"{tier.name}: a slot is free twice"
        in_use = {s for t, s in held + pending_in if t == index}
        assert not in_use & set(tier.free), f"{tier.name}: slots {in_use & set(tier.free)} free and held"
        u = usage[tier.name]
        assert u.free + u.used == u.total == tier.num_slots
        assert u.free == len(tier.free) and u.used == len(in_use), (
            f"{tier.name}: {u.used} slots used, {len(in_use)} held or pending swap-in")
        assert set(tier.free) | in_use == set(range(tier.num_slots))
    # What a swapped sequence left in the tiers (once its swap-out lands) is its tokens.
    for seq_id, seq in model.swapped.items():
        slots = swap.swapped[seq_id]
        held = seq.positions()
        assert len(slots) >= bm.blocks_for(len(held))
        got = [tiers_view.get(slots[i // bs], [None] * bs)[i % bs] for i in range(len(held))]
        assert got == [seq.tokens[p] for p in held], f"swapped {seq_id} holds {got}, its tokens are {seq.tokens}"
    # The real tiers hold what the shadow says (where the shadow knows a token).
    data = [tier.read(list(range(tier.num_slots)))[:, 0, 0, :, 0, 0].tolist() for tier in swap.tiers]
    for (tier, slot), slots in model.tiers.items():
        for i, token in enumerate(slots):
            assert token is None or data[tier][slot][i] == token, (
                f"{swap.tiers[tier].name} slot {slot}[{i}] holds {data[tier][slot][i]}, the shadow {token}")


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives the manager the way the scheduler, engine and runner do, in random orders.

    A sequence alternates between two states, as in LLMEngine.step:
      written == len(tokens) - 1: the last token was sampled, its K/V not yet written -> decode
      written == len(tokens):     the forward ran, the next token is not sampled yet  -> sample
    `fork` may happen in either state (the engine forks after the prefill forward, before sampling).
    Live sequences are picked by index from a plain list rather than a hypothesis Bundle, and rules
    with no live sequence do nothing (rather than preconditions), so that no draw is wasted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(8, 2)
        self.model = Model()
        self.reserve = 0
        self.next_id = 0
        self.freed_tokens: list[list[int]] = []  # preempted sequences come back with all their tokens

    @initialize(num_blocks=st.integers(4, 16), block_size=st.sampled_from([1, 2, 4]),
                reserve=st.sampled_from([0, 0, 0, 6]), host_blocks=st.integers(0, 4),
                disk_blocks=st.integers(0, 6))
    def setup(self, num_blocks: int, block_size: int, reserve: int, host_blocks: int,
              disk_blocks: int) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.reserve = reserve
        self.model.kv = KVPool(num_layers=1, num_blocks=num_blocks, block_size=block_size,
                               num_kv_heads=1, head_dim=1, dtype=torch.float32,
                               device=torch.device("cpu"))
        # The engine only swaps in paged mode, where nothing is reserved (engine_parts.build_engine_parts).
        if reserve == 0:
            self.model.swap = SwapSpace(self.model.kv, host_blocks, disk_blocks)

    def _new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    def _forward_after_swap_in(self) -> None:
        """Scheduler._swap_in leaves every running sequence room for its next block, so the step
        that swaps a sequence in preempts nobody, and its forward applies the swap-ins before any
        sequence is forked, finished or preempted. SwapSpace relies on this: `apply` runs all
        swap-outs before all swap-ins (and tier by tier), not in record order, so a block swapped
        in and then swapped out, or freed and swapped into again, before an apply would be read
        or written out of order."""
        if self.model.swapped_in:
            event("forward after a swap-in")
            apply_copies(self.bm, self.model)

    def _pick(self, index: int) -> str | None:
        ids = sorted(self.model.seqs)
        return ids[index % len(ids)] if ids else None

    @rule(prefix=st.sampled_from(PREFIXES), cut=st.one_of(st.just(8), st.integers(0, 8)),
          suffix=st.lists(ALPHABET, max_size=5), readmit=st.integers(0, 3))
    def admit(self, prefix: list[int], cut: int, suffix: list[int], readmit: int) -> None:
        """Scheduler._admit then the prefill forward: allocate_prompt, write the uncached tail."""
        if readmit == 0 and self.freed_tokens:
            tokens = list(self.freed_tokens[-1])  # a preempted sequence, recomputed
        else:
            tokens = prefix[:cut] + suffix
        if not tokens:
            tokens = [0]
        seq_id = self._new_id()
        before = (dict(self.bm.tables), self.bm.free_blocks, dict(self.bm.cache))
        grant = self.bm.allocate_prompt(seq_id, tokens, self.reserve)
        if grant is None:
            # All or nothing: a refused admission changes nothing.
            assert before == (dict(self.bm.tables), self.bm.free_blocks, dict(self.bm.cache))
            event("admit: refused")
            return
        bs, cached = self.bm.block_size, grant.cached
        assert grant.loads == ()  # no remote tier
        event("admit: prefix-cache hit" if cached else "admit: no hit")
        # Only whole blocks hit, and the last prompt token is always computed.
        assert cached % bs == 0 and cached <= len(tokens) - 1
        assert len(self.bm.tables[seq_id]) == self.bm.blocks_for(max(len(tokens), self.reserve))
        self.model.seqs[seq_id] = ShadowSeq(tokens, written=cached)
        apply_copies(self.bm, self.model)
        write(self.bm, self.model, seq_id, cached, len(tokens))

    @rule(index=st.integers(0, 63), token=ALPHABET)
    def advance(self, index: int, token: int) -> None:
        """Whichever half of LLMEngine.step is due for this sequence:

        sample: append the sampled token, register full blocks with num_computed = num_tokens - 1
                (everything but the new token is in the pool);
        decode: Scheduler._make_room_for_decode's allocate for the last token (copy-on-write if
                its block is shared), then the forward applies the copies and writes the token."""
        seq_id = self._pick(index)
        if seq_id is None:
            return
        seq = self.model.seqs[seq_id]
        if seq.written == len(seq.tokens):
            seq.tokens.append(token)
            if not seq.evicted:  # LLMEngine.step: evicted sequences register nothing
                seq.registered = len(seq.tokens) - 1
                self.bm.register_full_blocks(seq_id, list(seq.tokens), seq.registered)
            return
        n = len(seq.tokens)
        before = (dict(self.bm.tables), self.bm.free_blocks)
        copies = self.bm.allocate(seq_id, n - seq.evicted, self.reserve)
        if copies is None:
            # All or nothing: the scheduler preempts someone and retries.
            assert before == (dict(self.bm.tables), self.bm.free_blocks)
            event("decode: no room")
            return
        assert self.bm.num_tokens[seq_id] == n - seq.evicted
        self.model.copies += copies
        event("decode: copy-on-write" if copies else "decode: own block")
        apply_copies(self.bm, self.model)
        write(self.bm, self.model, seq_id, n - 1, n)

    @rule(index=st.integers(0, 63), draft=st.lists(ALPHABET, min_size=1, max_size=5), data=st.data())
    def speculate(self, index: int, draft: list[int], data: st.DataObject) -> None:
        """A decode that runs draft tokens after the last token (speculative decoding, paged mode
        only): slots for all of them, the forward writes them, the target accepts the first m and
        adds its own token (rejected slots may hold other tokens than the sequence's), and the
        rollback trims the tables to the sequence's tokens before its full blocks register."""
        seq_id = self._pick(index)
        if seq_id is None or self.reserve:
            return
        seq = self.model.seqs[seq_id]
        n = len(seq.tokens)
        if seq.written != n - 1 or seq.held is not None:
            return
        # As the scheduler does: the token's slot first (its block made its own), then the draft's.
        copies = self.bm.allocate(seq_id, n, num_computed=n - 1)
        grown = None if copies is None else self.bm.allocate(seq_id, n + len(draft), num_computed=n - 1)
        if grown is None:
            event("speculate: no room")
            if copies is not None:  # the token's slot stays: the next decode would take it
                self.model.copies += copies
            return
        self.model.copies += copies + grown
        apply_copies(self.bm, self.model)
        seq.tokens += draft
        write(self.bm, self.model, seq_id, n - 1, n + len(draft))
        accepted = data.draw(st.integers(0, len(draft)), label="accepted")
        del seq.tokens[n + accepted:]
        seq.tokens.append(data.draw(ALPHABET, label="target's token"))
        seq.written = n + accepted
        self.bm.trim(seq_id, len(seq.tokens))
        # Nothing past the tokens (the target's new one may still need its block from the next decode).
        assert self.bm.blocks_for(seq.written) <= len(self.bm.tables[seq_id]) <= self.bm.blocks_for(len(seq.tokens))
        seq.registered = seq.written
        self.bm.register_full_blocks(seq_id, list(seq.tokens), seq.written)
        event(f"speculate: {accepted} of {len(draft)} accepted")

    @rule(index=st.integers(0, 63))
    def fork(self, index: int) -> None:
        """Forks.fork_samples: the child shares all of the parent's blocks. It runs in the step's
        update, after the forward applied the step's copies: the engine never forks a block whose
        copy is pending (a later copy-on-write from it would read it before the copy lands)."""
        if self.model.copies:
            apply_copies(self.bm, self.model)
        self._forward_after_swap_in()
        parent = self._pick(index)
        if parent is None:
            return
        seq = self.model.seqs[parent]
        child = self._new_id()
        self.bm.fork(parent, child)
        self.model.seqs[child] = ShadowSeq(list(seq.tokens), seq.written, seq.registered,
                                           None if seq.held is None else list(seq.held))

    @rule(index=st.integers(0, 63))
    def free(self, index: int) -> None:
        """Finish, abort or preempt: the blocks go back; a preempted sequence may be readmitted."""
        self._forward_after_swap_in()
        seq_id = self._pick(index)
        if seq_id is None:
            return
        seq = self.model.seqs.pop(seq_id)
        event("free: with a pending copy" if self.model.copies else "free")
        # As Scheduler._make_room_for_decode: a preempted sequence's own copy is dropped, since
        # its destination goes back and a later copy of the step may take it.
        gone = set(self.bm.tables[seq_id])
        self.model.copies = [c for c in self.model.copies if c[1] not in gone]
        self.bm.free(seq_id)
        assert seq_id not in self.bm.tables and seq_id not in self.bm.num_tokens
        self.freed_tokens.append(seq.tokens)

    @rule(index=st.integers(0, 63))
    def swap_out(self, index: int) -> None:
        """Scheduler.preempt by swap: swap_out(seq_id, table), then free its device blocks."""
        self._forward_after_swap_in()
        swap = self.model.swap
        seq_id = self._pick(index)
        if swap is None or seq_id is None:
            return
        table = list(self.bm.tables[seq_id])
        if any(dst in table for _, dst in self.model.copies):
            # The scheduler recomputes a sequence whose copy is pending: the swap-out, which lands
            # before the copies, would save the block unfilled.
            event("swap out: copy pending")
            return
        before = (dict(swap.swapped), [list(t.free) for t in swap.tiers])
        copies = swap.swap_out(seq_id, self.bm.tables[seq_id])
        if copies is None:
            # Tiers full: nothing changes and the sequence stays running.
            assert len(table) > swap.free_slots
            assert before == (dict(swap.swapped), [list(t.free) for t in swap.tiers])
            assert self.bm.tables[seq_id] == table
            event("swap out: tiers full")
            return
        slots = swap.swapped[seq_id]
        assert len(slots) == len(table)
        assert copies == tuple((block, tier, slot) for (tier, slot), block in zip(slots, table))
        self.model.swap_out += copies
        for (tier, slot), block in zip(slots, table):
            self.model.pending_swaps.append(("out", block, tier, slot))
        for name in sorted({swap.tiers[tier].name for tier, _ in slots}):
            event(f"swap out: to {name}")
        self.bm.free(seq_id)
        self.model.swapped[seq_id] = self.model.seqs.pop(seq_id)

    @rule(index=st.integers(0, 63))
    def swap_in(self, index: int) -> None:
        """Scheduler._swap_in: allocate the sequence's blocks (all or nothing), then swap_in."""
        swap = self.model.swap
        if swap is None or not self.model.swapped:
            return
        ids = sorted(self.model.swapped)
        seq_id = ids[index % len(ids)]
        seq = self.model.swapped[seq_id]
        before = (dict(self.bm.tables), self.bm.free_blocks)
        copies = self.bm.allocate(seq_id, len(seq.tokens) - seq.evicted)
        if copies is None:
            assert before == (dict(self.bm.tables), self.bm.free_blocks)
            event("swap in: no room")
            return
        assert copies == (), "a new table shares no block to copy"
        slots = swap.swapped[seq_id]
        table = self.bm.tables[seq_id]
        assert all(self.bm.blocks[b].ref_count == 1 for b in table), "swapped in into a shared block"
        back = swap.swap_in(seq_id, table)
        assert back == tuple((tier, slot, block) for (tier, slot), block in zip(slots, table))
        self.model.swap_in += back
        for (tier, slot), block in zip(slots, table):
            self.model.pending_swaps.append(("in", tier, slot, block))
        event("swap in")
        self.model.seqs[seq_id] = self.model.swapped.pop(seq_id)
        self.model.swapped_in.add(seq_id)

    @rule(index=st.integers(0, 63))
    def discard(self, index: int) -> None:
        """Scheduler.finish of a swapped sequence (an abort): its slots are free again."""
        swap = self.model.swap
        if swap is None or not self.model.swapped:
            return
        ids = sorted(self.model.swapped)
        seq_id = ids[index % len(ids)]
        self.bm.free(seq_id)  # finish frees first: a no-op, it has no table
        swap.discard(seq_id)
        del self.model.swapped[seq_id]
        event("discard")

    @rule(index=st.integers(0, 63), data=st.data())
    def evict(self, index: int, data: st.DataObject) -> None:
        """EvictionStep.evict after a forward: keep a subset of a sequence's slots (as a policy
        would, one head), moving kept slots from past the kept count into dropped ones below it.
        The engine evicts right after a forward, which applied every move returned before it."""
        apply_copies(self.bm, self.model)
        seq_id = self._pick(index)
        if seq_id is None:
            return
        seq = self.model.seqs[seq_id]
        held = seq.positions()
        if seq.written != len(seq.tokens) or len(held) < 2:
            return
        keep = sorted(data.draw(st.sets(st.integers(0, len(held) - 1), min_size=1, max_size=len(held) - 1)))
        kept = len(keep)
        holes = [i for i in range(kept) if i not in keep]
        sources = [i for i in keep if i >= kept]
        zeros = torch.zeros(len(holes), dtype=torch.long)
        before = (dict(self.bm.tables), self.bm.free_blocks, dict(self.bm.cache))
        compaction = self.bm.compact(seq_id, zeros, zeros, torch.tensor(sources, dtype=torch.long),
                                     torch.tensor(holes, dtype=torch.long), kept)
        if compaction is None:
            assert before == (dict(self.bm.tables), self.bm.free_blocks, dict(self.bm.cache))
            event("evict: no room for copies")
            return
        moved = dict(zip(holes, sources))
        seq.held = [held[moved.get(i, i)] for i in range(kept)]
        assert self.bm.num_tokens[seq_id] == kept
        assert len(self.bm.tables[seq_id]) == self.bm.blocks_for(kept)
        self.model.compactions.append(compaction)
        event("evict: copies" if compaction.copies else "evict")

    @rule()
    def run_copies(self) -> None:
        """A forward with nothing new for these sequences still applies the pending swaps, then
        the pending copies."""
        apply_copies(self.bm, self.model)

    @invariant()
    def consistent(self) -> None:
        check_invariants(self.bm, self.model)

    def teardown(self) -> None:
        swap = self.model.swap
        for seq_id in list(self.model.swapped):
            swap.discard(seq_id)
            del self.model.swapped[seq_id]
        for seq_id in list(self.model.seqs):
            self.bm.free(seq_id)
            del self.model.seqs[seq_id]
        apply_copies(self.bm, self.model)
        check_invariants(self.bm, self.model)
        assert not self.bm.tables and not self.bm.num_tokens
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        assert len(self.bm.free_blocks) == self.bm.num_blocks
        if swap is not None:
            assert not swap.swapped
            for u in swap.usage():
                assert u.used == 0 and u.free == u.total, f"{u.name} tier not entirely free: {u}"
            for tier in swap.tiers:
                if isinstance(tier, DiskTier):
                    tier._file.close()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=400, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestBlockManagerMachine = BlockManagerMachine.TestCase


# -- eviction order -------------------------------------------------------------------------------

@st.composite
def lru_scenarios(draw: st.DrawFn) -> tuple[int, list[tuple[int, int]], list[int], int | None, int]:
    """block_size; per sequence (full blocks, tail tokens 1..bs-1); free order; optionally one
    freed sequence admitted again (a cache hit) and freed last; untouched blocks in the pool."""
    bs = draw(st.sampled_from([2, 4]))
    shapes = draw(st.lists(st.tuples(st.integers(1, 3), st.integers(1, bs - 1)), min_size=1, max_size=4))
    order = draw(st.permutations(range(len(shapes))))
    touch = draw(st.none() | st.integers(0, len(shapes) - 1))
    spare = draw(st.integers(1, 3))  # >= 1 so the re-admission's tail block is never a cached one
    return bs, shapes, list(order), touch, spare


@settings(max_examples=150, deadline=None)
@given(lru_scenarios())
def test_eviction_is_lru_deeper_first_and_never_full_blocks_go_first(
        scenario: tuple[int, list[tuple[int, int]], list[int], int | None, int]) -> None:
    bs, shapes, order, touch, spare = scenario
    num_blocks = sum(full + 1 for full, _ in shapes) + spare
    bm = BlockManager(num_blocks, bs)
    # Distinct tokens per sequence, so no two sequences share a block.
    prompts = [[1000 * (i + 1) + t for t in range(full * bs + tail)] for i, (full, tail) in enumerate(shapes)]
    for i, prompt in enumerate(prompts):
        assert bm.allocate_prompt(f"s{i}", prompt).cached == 0
        bm.register_full_blocks(f"s{i}", prompt, len(prompt))  # as after the prefill step
    full_blocks = {i: bm.tables[f"s{i}"][:shapes[i][0]] for i in range(len(shapes))}
    never_full = set(range(num_blocks)) - {b for blocks in full_blocks.values() for b in blocks}
    for i in order:
        bm.free(f"s{i}")
    if touch is not None:
        # A hit makes the sequence's blocks the most recently used once freed again.
        assert bm.allocate_prompt("again", prompts[touch]).cached == shapes[touch][0] * bs
        assert bm.tables["again"][:shapes[touch][0]] == full_blocks[touch]
        bm.free("again")
        order = [i for i in order if i != touch] + [touch]
    assert bm.usage().cached == sum(full for full, _ in shapes)
    # Least recently freed first; within one sequence the deepest block first, so a prefix is
    # never evicted while a block that continues it stays cached (it could no longer be hit).
    expected_cached = [b for i in order for b in reversed(full_blocks[i])]
    # Taking every block for an unrelated sequence shows the order they are reused in.
    assert bm.allocate("taker", num_blocks * bs) is not None
    taken = bm.tables["taker"]
    assert set(taken[:len(never_full)]) == never_full, "a cached block was evicted before a never-full one"
    assert taken[len(never_full):] == expected_cached
    assert not bm.cache, "every evicted block must leave the cache"
    assert all(b.hash is None and b.token_ids == () for b in bm.blocks)


@settings(max_examples=100, deadline=None)
@given(bs=st.sampled_from([1, 2, 4]), full=st.integers(1, 3), extra=st.integers(0, 3),
       evict=st.integers(0, 6))
def test_partial_eviction_keeps_the_remaining_prefix_hittable(bs: int, full: int, extra: int,
                                                              evict: int) -> None:
    """After k blocks are evicted from a freed sequence's cached chain (deepest first), a new
    prompt with the same tokens still hits exactly the surviving prefix of the chain."""
    num_blocks = full + 1 + extra
    bm = BlockManager(num_blocks, bs)
    prompt = list(range(full * bs + 1))  # `full` full blocks and a one-token tail
    assert bm.allocate_prompt("a", prompt).cached == 0
    bm.register_full_blocks("a", prompt, len(prompt))
    bm.free("a")
    evict = min(evict, full)
    # Use up every never-full block, then `evict` cached ones.
    assert bm.allocate("taker", (num_blocks - full + evict) * bs) is not None
    assert bm.usage().cached == full - evict
    bm.free("taker")
    assert bm.allocate_prompt("b", prompt).cached == (full - evict) * bs
