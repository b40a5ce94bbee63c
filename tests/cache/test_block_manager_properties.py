"""Property-based tests of the BlockManager: random admit / decode / fork / free interleavings
checked against a shadow model of every sequence's tokens and of the KV pool's slots.

The pool is simulated as block_id -> list of token ids "written" into each slot. A write happens
only where the engine's forward would write (prefill after `allocate_prompt`, one token after
`allocate`), always after the pending copy-on-write copies are applied, as the model runner does.
Reading every sequence's block table slot by slot through that simulated pool must give back the
sequence's own tokens: this is what shows that prefix-cache hits and copy-on-write are correct.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvserve.cache.block_manager import BlockManager

Pool = dict[int, list[int | None]]

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
    written: int  # positions [0, written) hold this sequence's K/V (in the simulated pool)
    registered: int = 0  # the num_computed last passed to register_full_blocks


@dataclass
class Model:
    seqs: dict[str, ShadowSeq] = field(default_factory=dict)
    pool: Pool = field(default_factory=dict)


def with_copies(pool: Pool, copies: list[tuple[int, int]], block_size: int) -> Pool:
    """The pool as it is after `KVPool.copy_blocks(copies)`: `k[dst] = k[src]` gathers every src
    first, then scatters, so all sources are read before any destination is written. A source
    nobody wrote yet (say, a reserved block) copies as empty slots."""
    gathered = [(dst, list(pool.get(src, [None] * block_size))) for src, dst in copies]
    out = {b: list(slots) for b, slots in pool.items()}
    for dst, slots in gathered:
        out[dst] = slots
    return out


def apply_copies(bm: BlockManager, model: Model) -> None:
    """What ModelRunner.forward does first: apply the pending copies, then clear them."""
    model.pool = with_copies(model.pool, bm.pending_copies, bm.block_size)
    bm.pending_copies.clear()


def write(bm: BlockManager, model: Model, seq_id: str, start: int, end: int) -> None:
    """The forward pass writes `seq_id`'s tokens [start, end) into its blocks' slots.

    A write must land in a block this sequence alone owns (else it would change a sibling's or a
    cached prefix's K/V) and that is not in the prefix cache (whose contents must stay fixed)."""
    assert not bm.pending_copies, "copies must be applied before the forward writes"
    seq = model.seqs[seq_id]
    table = bm.tables[seq_id]
    bs = bm.block_size
    for pos in range(start, end):
        block_id = table[pos // bs]
        block = bm.blocks[block_id]
        assert block.ref_count == 1, (
            f"{seq_id} writes position {pos} into block {block_id} with ref_count {block.ref_count}")
        assert block.hash is None, f"{seq_id} writes position {pos} into cached block {block_id}"
        slots = model.pool.setdefault(block_id, [None] * bs)
        slots[pos % bs] = seq.tokens[pos]
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
    # The contents once the pending copies land (the next forward applies them before reading).
    view = with_copies(model.pool, bm.pending_copies, bm.block_size)
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
        assert read(bm, view, seq_id, seq.written) == seq.tokens[:seq.written], (
            f"{seq_id} reads {read(bm, view, seq_id, seq.written)}, "
            f"its tokens are {seq.tokens[:seq.written]}")


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
                reserve=st.sampled_from([0, 0, 0, 6]))
    def setup(self, num_blocks: int, block_size: int, reserve: int) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.reserve = reserve

    def _new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

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
        cached = self.bm.allocate_prompt(seq_id, tokens, self.reserve)
        if cached is None:
            # All or nothing: a refused admission changes nothing.
            assert before == (dict(self.bm.tables), self.bm.free_blocks, dict(self.bm.cache))
            event("admit: refused")
            return
        bs = self.bm.block_size
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
            seq.registered = len(seq.tokens) - 1
            self.bm.register_full_blocks(seq_id, list(seq.tokens), seq.registered)
            return
        n = len(seq.tokens)
        before = (dict(self.bm.tables), self.bm.free_blocks, list(self.bm.pending_copies))
        if not self.bm.allocate(seq_id, n, self.reserve):
            # All or nothing: the scheduler preempts someone and retries.
            assert before == (dict(self.bm.tables), self.bm.free_blocks, list(self.bm.pending_copies))
            event("decode: no room")
            return
        assert self.bm.num_tokens[seq_id] == n
        event("decode: copy-on-write" if self.bm.pending_copies else "decode: own block")
        apply_copies(self.bm, self.model)
        write(self.bm, self.model, seq_id, n - 1, n)

    @rule(index=st.integers(0, 63))
    def fork(self, index: int) -> None:
        """LLMEngine._fork_samples: the child shares all of the parent's blocks."""
        parent = self._pick(index)
        if parent is None:
            return
        seq = self.model.seqs[parent]
        child = self._new_id()
        self.bm.fork(parent, child)
        self.model.seqs[child] = ShadowSeq(list(seq.tokens), seq.written, seq.registered)

    @rule(index=st.integers(0, 63))
    def free(self, index: int) -> None:
        """Finish, abort or preempt: the blocks go back; a preempted sequence may be readmitted."""
        seq_id = self._pick(index)
        if seq_id is None:
            return
        seq = self.model.seqs.pop(seq_id)
        event("free: with a pending copy" if self.bm.pending_copies else "free")
        self.bm.free(seq_id)
        assert seq_id not in self.bm.tables and seq_id not in self.bm.num_tokens
        self.freed_tokens.append(seq.tokens)

    @rule()
    def run_copies(self) -> None:
        """A forward with nothing new for these sequences still applies the pending copies."""
        apply_copies(self.bm, self.model)

    @invariant()
    def consistent(self) -> None:
        check_invariants(self.bm, self.model)

    def teardown(self) -> None:
        for seq_id in list(self.model.seqs):
            self.bm.free(seq_id)
            del self.model.seqs[seq_id]
        check_invariants(self.bm, self.model)
        assert not self.bm.tables and not self.bm.num_tokens
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        assert len(self.bm.free_blocks) == self.bm.num_blocks


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
        assert bm.allocate_prompt(f"s{i}", prompt) == 0
        bm.register_full_blocks(f"s{i}", prompt, len(prompt))  # as after the prefill step
    full_blocks = {i: bm.tables[f"s{i}"][:shapes[i][0]] for i in range(len(shapes))}
    never_full = set(range(num_blocks)) - {b for blocks in full_blocks.values() for b in blocks}
    for i in order:
        bm.free(f"s{i}")
    if touch is not None:
        # A hit makes the sequence's blocks the most recently used once freed again.
        assert bm.allocate_prompt("again", prompts[touch]) == shapes[touch][0] * bs
        assert bm.tables["again"][:shapes[touch][0]] == full_blocks[touch]
        bm.free("again")
        order = [i for i in order if i != touch] + [touch]
    assert bm.usage().cached == sum(full for full, _ in shapes)
    # Least recently freed first; within one sequence the deepest block first, so a prefix is
    # never evicted while a block that continues it stays cached (it could no longer be hit).
    expected_cached = [b for i in order for b in reversed(full_blocks[i])]
    # Taking every block for an unrelated sequence shows the order they are reused in.
    assert bm.allocate("taker", num_blocks * bs)
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
    assert bm.allocate_prompt("a", prompt) == 0
    bm.register_full_blocks("a", prompt, len(prompt))
    bm.free("a")
    evict = min(evict, full)
    # Use up every never-full block, then `evict` cached ones.
    assert bm.allocate("taker", (num_blocks - full + evict) * bs)
    assert bm.usage().cached == full - evict
    bm.free("taker")
    cached = bm.allocate_prompt("b", prompt)
    assert cached == (full - evict) * bs
