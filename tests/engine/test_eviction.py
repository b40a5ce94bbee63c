"""Token eviction in the engine: what the pool holds after compaction, equality with no eviction
when the budget covers the context, exact replay after preemption, and no leaked block."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cache.block_ops import BlockOps
from kvserve.engine.llm_engine import LLMEngine

# Every test also runs in a pool that preempts (tests/conftest.py, forced_preemption).
pytestmark = pytest.mark.forced_preemption

POLICIES = ["window", "strided", "h2o", "tova", "snapkv"]
# Evict every step (interval 1): the tests below count slots token by token.
KNOBS = dict(kv_observation_window=8, kv_window=8, kv_sink_tokens=2, kv_stride=3, kv_evict_interval=1)


def prompts(n: int, length: int) -> list[list[int]]:
    return [[(i * 13 + j * 7 + j * j) % 120 + 3 for j in range(length + 5 * i)] for i in range(n)]


def forced_params(tokens: int, seed: int = 0, **kw: Any) -> list[SamplingParams]:
    g = torch.Generator().manual_seed(seed)
    return [SamplingParams(max_tokens=tokens, temperature=0, logprobs=-1, ignore_eos=True,
                           forced_token_ids=torch.randint(3, 120, (tokens,), generator=g).tolist(), **kw)]


def applied_compactions(engine: LLMEngine) -> list[BlockOps]:
    """The block moves with compactions the engine hands its runner, in a list that grows as it
    steps (the engine applies a step's compactions right after it)."""
    applied: list[BlockOps] = []
    move_blocks = engine.runner.move_blocks

    def recording(ops: BlockOps) -> None:
        if ops.compactions:
            applied.append(ops)
        move_blocks(ops)

    engine.runner.move_blocks = recording
    return applied


def full_logprobs(llm: LLM, batch: list[list[int]], tokens: int, **kw: Any) -> list[torch.Tensor]:
    params = [p for i in range(len(batch)) for p in forced_params(tokens, seed=i, **kw)]
    outs = llm.generate(batch, params, use_tqdm=False)
    return [torch.stack([lp.full for lp in o.logprobs]) for o in outs]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_budget_covering_the_context_changes_nothing(tiny_llm: Callable[..., LLM], policy: str) -> None:
    batch = prompts(3, 40)
    want = full_logprobs(tiny_llm(), batch, 20)
    got = full_logprobs(tiny_llm(kv_eviction=policy, kv_budget=70, **KNOBS), batch, 20)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_a_request_overrides_the_engine_policy(tiny_llm: Callable[..., LLM]) -> None:
    batch = prompts(2, 40)
    plain = full_logprobs(tiny_llm(), batch, 16)
    llm = tiny_llm(kv_eviction="window", kv_budget=20, **KNOBS)
    evicting = full_logprobs(llm, batch, 16)
    assert llm.engine.stats()["kv_evicted_tokens"]["window"] > 0
    assert not torch.allclose(evicting[0], plain[0])
    opted_out = full_logprobs(llm, batch, 16, kv_eviction="none")
    torch.testing.assert_close(opted_out[0], plain[0], rtol=0, atol=0)


@pytest.mark.parametrize("policy", ["window", "tova"])
def test_an_eviction_interval_of_a_block_holds_the_same_blocks(tiny_llm: Callable[..., LLM], policy: str) -> None:
    """Evicting a block's worth at a time keeps a sequence within budget + interval - 1 slots and
    at the block count of evicting every step (a block is freed per 16 dropped tokens either
    way), with 1/16 of the compactions; TOVA is scored only on the steps that evict."""
    knobs = {**KNOBS, "kv_evict_interval": None}  # the default: block_size (16)
    seen: dict[int, tuple[int, int, int]] = {}
    for interval in (1, 16):
        llm = tiny_llm(kv_eviction=policy, kv_budget=32, **{**knobs, "kv_evict_interval": interval})
        engine = llm.engine
        engine.add_request(prompts(1, 20)[0], forced_params(60)[0], request_id="r")  # grows past the budget
        applied = applied_compactions(engine)
        most_slots = compactions = 0
        while engine.has_unfinished():
            before = len(applied)
            engine.step()
            seq = next(iter(engine.scheduler.running), None)
            if seq is None:
                break
            most_slots = max(most_slots, seq.kv_state.num_slots)
            compactions += len(applied) > before
        # Blocks are allocated before a step writes its token, so the peak counts the one in flight.
        seen[interval] = most_slots, engine.block_manager.peak_used, compactions
    assert seen[1][0] == 32 and seen[16][0] == 32 + 15
    assert seen[1][1] == seen[16][1] == 3  # 32 kept + 1 or 15 more: three blocks of 16 either way
    assert seen[16][2] * 8 <= seen[1][2]
    with pytest.raises(ValueError, match="EvictionOptions.kv_evict_interval"):
        tiny_llm(kv_eviction=policy, kv_budget=32, kv_evict_interval=0)


def run_until(engine: LLMEngine, steps: int) -> None:
    for _ in range(steps):
        engine.step()


@pytest.mark.parametrize("kv_cache_dtype, prefill_chunk", [("auto", None), ("int8", None), ("auto", 16)])
@pytest.mark.parametrize("policy", POLICIES)
def test_layer0_pages_hold_the_kept_positions(tiny_llm: Callable[..., LLM], policy: str, kv_cache_dtype: str,
                                              prefill_chunk: int | None) -> None:
    """Layer 0's K and V of a position do not depend on the rest of the context, so each slot of
    an evicting sequence must hold exactly what an unevicted run holds for the position its
    state says the slot keeps, per KV head (also when prompts are evicted chunk by chunk)."""
    batch = prompts(2, 45)
    plain = tiny_llm(kv_cache_dtype=kv_cache_dtype)
    evicting = tiny_llm(kv_eviction=policy, kv_budget=24, kv_cache_dtype=kv_cache_dtype,
                        kv_prefill_chunk=prefill_chunk, **KNOBS)
    for llm in (plain, evicting):
        for i, prompt in enumerate(batch):
            llm.engine.add_request(prompt, forced_params(30, seed=i)[0], request_id=str(i))
        run_until(llm.engine, 20)  # prompts and some decode steps; both still running
    # The last step's compactions travel at the head of the next step's moves: applied here as
    # that step would, the pages hold every compaction decided so far.
    evicting.engine.runner.move_blocks(evicting.engine.scheduler.take_carried())
    bs = plain.engine.block_manager.block_size
    for i in range(2):
        seq = next(s for s in evicting.engine.scheduler.running if s.request_id == str(i))
        state = seq.kv_state
        # Between evictions a sequence holds one token past its budget (SnapKV: a window's worth).
        assert state.num_evicted > 0 and state.num_slots <= 24 + (8 if policy == "snapkv" else 1)
        kept_table = torch.tensor(evicting.engine.block_manager.tables[str(i)])
        full_table = torch.tensor(plain.engine.block_manager.tables[str(i)])
        assert len(kept_table) == -(-state.num_slots // bs)
        for page, (ev_tensors, pl_tensors) in enumerate(zip(pages(evicting), pages(plain))):
            for ev, pl in zip(ev_tensors, pl_tensors):
                slots = torch.arange(state.num_slots)
                got = ev.view(-1, *ev.shape[2:])[kept_table[slots // bs] * bs + slots % bs]  # [S, H, ...]
                for head in range(ev.shape[2]):
                    pos = state.positions[0, head]
                    want = pl.view(-1, *pl.shape[2:])[full_table[pos // bs] * bs + pos % bs]
                    # Bit for bit, except that 16-row chunks take another matmul blocking than 45 rows.
                    tol = 0 if prefill_chunk is None else 1e-6
                    torch.testing.assert_close(got[:, head], want[:, head], rtol=tol, atol=tol)
    for llm in (plain, evicting):
        for i in range(2):
            llm.engine.abort(str(i))


def pages(llm: LLM) -> list[list[torch.Tensor]]:
    """Layer 0's page tensors: K and V, or each field of a compressed format."""
    pool = llm.engine.pool
    if hasattr(pool, "layers"):
        return [list(pool.layers[0])]
    return [list(fields.values()) for fields in pool.kv[0].fields]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_preempted_sequence_replays_its_evictions(tiny_llm: Callable[..., LLM], policy: str) -> None:
    # Prompts shorter than the budget grow during decoding, past what 9 blocks hold for four.
    batch = prompts(4, 20)
    want = full_logprobs(tiny_llm(kv_eviction=policy, kv_budget=32, **KNOBS), batch, 40)
    small = tiny_llm(kv_eviction=policy, kv_budget=32, kv_cache_memory=str(9 * 8192), **KNOBS)
    got = full_logprobs(small, batch, 40)
    assert small.engine.scheduler.num_preemptions > 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_prompt_evicted_chunk_by_chunk_replays_after_preemption(tiny_llm: Callable[..., LLM], policy: str) -> None:
    """Chunk ends are positions, not the scheduler's cuts: a step budget that splits chunks
    differently, and preemption by recompute, give the same outputs."""
    batch = prompts(4, 50)
    knobs = dict(kv_eviction=policy, kv_budget=32, kv_prefill_chunk=16, **KNOBS)
    want = full_logprobs(tiny_llm(**knobs), batch, 30)
    small = tiny_llm(kv_cache_memory=str(9 * 8192), max_num_batched_tokens=20, max_num_seqs=4, **knobs)
    got = full_logprobs(small, batch, 30)
    assert small.engine.scheduler.num_preemptions > 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy, chunk", [("h2o", 16), ("snapkv", 16), ("tova", 16)])
def test_a_recomputed_sequence_hitting_its_own_prompt_blocks_replays_its_evictions(
        tiny_llm: Callable[..., LLM], policy: str, chunk: int | None) -> None:
    """Prompts longer than the budget, a pool that preempts by recompute: the recomputed sequence
    finds its own prompt blocks in the prefix cache, and takes only what its policy never reads."""
    batch = [[(i * 31 + j * 17 + j * j) % 120 + 3 for j in range(30 + 9 * i)] for i in range(6)]
    # Evicting a block at a time (the default interval), each sequence grows to 40 slots.
    knobs = dict(kv_eviction=policy, kv_budget=24, kv_prefill_chunk=chunk, max_num_seqs=4,
                 kv_observation_window=8, kv_window=8)
    want = full_logprobs(tiny_llm(**knobs), batch, 30)
    small = tiny_llm(kv_cache_memory=str(7 * 8192), **knobs)
    got = full_logprobs(small, batch, 30)
    assert small.engine.scheduler.num_preemptions > 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["window", "tova", "strided"])
def test_an_evicting_request_short_of_blocks_for_its_compaction_is_recomputed(tiny_llm: Callable[..., LLM],
                                                                              policy: str) -> None:
    """Beside requests sharing its prefix in a pool of 6 blocks, an evicting request's compaction
    must copy the shared blocks it writes and finds no free ones. Run on un-evicted it kept other
    tokens than alone (found by a combination tester); it is recomputed instead."""
    base = [(7 * j + 3) % 128 for j in range(40)]
    evicting = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, kv_eviction=policy, kv_budget=20)
    filler = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    alone = tiny_llm().generate([base + [5]], evicting, use_tqdm=False)[0].token_ids
    llm = tiny_llm(kv_cache_memory="48KiB", max_num_seqs=8)
    outs = llm.generate([base + [1], base + [5], base + [2], base + [3]], [filler, evicting, filler, filler],
                        use_tqdm=False)
    assert outs[1].token_ids == alone
    assert llm.engine.scheduler.num_preemptions > 0


def test_two_evicting_requests_short_of_blocks_together_both_finish(tiny_llm: Callable[..., LLM]) -> None:
    """Both hit the same cached prefix in a pool of 5 blocks and reach their prompt's end in one
    step, each needing copies of the blocks the other shares. Recomputed together they met again
    at every step, forever; the first is recomputed at once, so the second finds its blocks."""
    base = [(7 * j + 3) % 128 for j in range(40)]
    evicting = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, kv_eviction="window", kv_budget=20)
    prompts = [base + [5], base + [6]]
    alone = [tiny_llm().generate([p], evicting, use_tqdm=False)[0].token_ids for p in prompts]
    llm = tiny_llm(kv_cache_memory="40KiB", max_num_seqs=8)
    llm.generate([base + [9]], SamplingParams(max_tokens=1), use_tqdm=False)  # the prefix, cached
    engine = llm.engine
    for p in prompts:
        engine.add_request(p, evicting)
    finished: dict[str, list[int]] = {}
    for _ in range(100):
        finished |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
        if not engine.has_unfinished():
            break
    assert [finished.get(rid) for rid in sorted(finished)] == alone and len(finished) == 2
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("policy", ["window", "snapkv"])
def test_a_prompt_evicted_chunk_by_chunk_holds_budget_plus_a_chunk(tiny_llm: Callable[..., LLM], policy: str) -> None:
    """A 100-token prompt at budget 24: judged whole it takes 7 blocks of 16 before its first
    eviction; in chunks of 16 it never holds more than 24 + 16 slots (3 blocks), and it is cut
    back at 32, 48, 64, 80 and 96, then at its end."""
    peaks = {}
    for chunk in (None, 16):
        llm = tiny_llm(kv_eviction=policy, kv_budget=24, kv_prefill_chunk=chunk, **KNOBS)
        llm.generate([list(range(3, 103))], forced_params(4)[0], use_tqdm=False)
        peaks[chunk] = llm.engine.block_manager.peak_used
    assert peaks == {None: 7, 16: 3}
    with pytest.raises(ValueError, match="EvictionOptions.kv_prefill_chunk"):
        tiny_llm(kv_eviction="snapkv", kv_budget=24, kv_prefill_chunk=4, **KNOBS)  # below its window of 8
    with pytest.raises(ValueError, match="EvictionOptions.kv_prefill_chunk"):
        tiny_llm(kv_prefill_chunk=0)


@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_with_forks_beams_swaps_and_shared_prefixes_leaks_nothing(
        tiny_llm: Callable[..., LLM], policy: str) -> None:
    shared = prompts(1, 48)[0]
    batch = [shared, shared[:40] + [5, 6, 7, 8, 9, 10, 11, 12, 13], shared + [1, 2]]
    for options in (dict(), dict(preemption_mode="swap"), dict(kv_cache_dtype="int8")):
        llm = tiny_llm(kv_eviction=policy, kv_budget=24, kv_cache_memory=str(20 * 8192), max_num_seqs=6,
                       **KNOBS, **options)
        outs = llm.generate(batch, [SamplingParams(max_tokens=30, n=2, temperature=1.0, seed=1, ignore_eos=True),
                                    SamplingParams(max_tokens=20, beam_width=2, ignore_eos=True),
                                    SamplingParams(max_tokens=36, temperature=0, ignore_eos=True)], use_tqdm=False)
        assert [len(o.token_ids) for o in outs] == [30, 30, 20, 36]
        stats = llm.engine.stats()
        assert stats["kv_evicted_tokens"][policy] > 0 and stats["kv_blocks_freed_by_eviction"] > 0


def test_a_prefix_cached_by_an_evicting_sequence_serves_correct_output(tiny_llm: Callable[..., LLM]) -> None:
    """The evicting request's prompt blocks were registered before it evicted; blocks it wrote
    afterwards must not be served. A later request hitting the prefix equals a cold run."""
    batch = prompts(1, 64)
    cold = full_logprobs(tiny_llm(), batch, 12)
    llm = tiny_llm(kv_eviction="window", kv_budget=24, **KNOBS)
    full_logprobs(llm, batch, 40)  # evicts, and its prompt blocks stay cached
    hit = full_logprobs(llm, batch, 12, kv_eviction="none")
    assert llm.engine.block_manager.prefix_stats.cached_tokens > 0
    torch.testing.assert_close(hit[0], cold[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [None, 16])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_prefix_cache_hit_changes_nothing_an_evicting_sequence_keeps(tiny_llm: Callable[..., LLM], policy: str,
                                                                      chunk: int | None) -> None:
    """A cached position's query never runs: H2O (every prompt query) and SnapKV (its window's)
    would rank without its attention, and a hit past a chunk end would skip that chunk's
    eviction. Such sequences take only the part of a cached prefix their policy never reads, so
    a warm cache gives the outputs of prefix caching off."""
    shared = prompts(1, 60)[0]
    batch = [shared, shared[:44] + [5, 6, 7, 8, 9, 10, 11, 12], shared[:50] + [3] * 14]
    # Blocks of 8: with chunks of 16 a hit may take one (up to 15 tokens; SnapKV up to 16 - 8).
    knobs = dict(kv_eviction=policy, kv_budget=24, kv_prefill_chunk=chunk, block_size=8, **KNOBS)
    want = full_logprobs(tiny_llm(enable_prefix_caching=False, **knobs), batch, 12)
    warm = tiny_llm(**knobs)
    full_logprobs(warm, batch[:1], 4)
    got = full_logprobs(warm, batch, 12)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # The parts a policy does not read still come from the cache.
    assert (warm.engine.block_manager.prefix_stats.cached_tokens > 0) == (policy != "h2o")


@pytest.mark.parametrize("policy", POLICIES)
def test_evicting_once_at_the_prompt_end_lets_the_cache_grow(tiny_llm: Callable[..., LLM], policy: str) -> None:
    llm = tiny_llm(kv_eviction=policy, kv_budget=24, kv_evict_during_decode=False, **KNOBS)
    full_logprobs(llm, prompts(1, 45), 20)
    # Strided keeps 2 sinks, 8 recent and the 12 positions in 3..36 divisible by 3: 22 of 24.
    kept = 22 if policy == "strided" else 24
    assert llm.engine.stats()["kv_evicted_tokens"][policy] == 45 - kept


def test_compaction_returns_whole_blocks(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm(kv_eviction="window", kv_budget=20, block_size=8)
    llm.generate([list(range(3, 67))], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    # 64 prompt tokens in 8 blocks of 8; kept 20 -> 3 blocks; the three decode steps write slot
    # 20 and evict back to 20 inside the third block.
    assert llm.engine.block_manager.evicted_blocks == 8 - 3


@pytest.mark.parametrize("bad, field", [
    (dict(kv_eviction="lru"), "SamplingParams.kv_eviction"),
    (dict(kv_eviction="window", kv_budget=0), "SamplingParams.kv_budget"),
    (dict(kv_eviction="window", kv_budget=2), "SamplingParams.kv_budget"),
    (dict(kv_eviction="h2o", kv_budget=8), "SamplingParams.kv_budget"),
    (dict(kv_eviction="tova"), "SamplingParams.kv_budget"),
])
def test_bad_request_settings_name_the_field(tiny_llm: Callable[..., LLM], bad: dict[str, Any], field: str) -> None:
    llm = tiny_llm(kv_window=8, kv_sink_tokens=2)
    with pytest.raises(ValueError, match=field):
        llm.engine.add_request([1, 2, 3], SamplingParams(**bad))
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # the engine still serves


def test_an_engine_budget_without_a_policy_is_the_budget_of_requests_that_pick_one(
        tiny_llm: Callable[..., LLM]) -> None:
    """LLM(kv_budget=16) with no kv_eviction is not a budget that does nothing (issue 39 asked):
    a request that picks a policy and no budget keeps the engine's 16, one that picks none
    keeps every token."""
    llm = tiny_llm(kv_budget=16)
    prompt, params = [list(range(3, 80))], dict(max_tokens=8, temperature=0, ignore_eos=True)
    llm.generate(prompt, SamplingParams(**params), use_tqdm=False)
    assert not llm.engine.evicted_tokens
    llm.generate(prompt, SamplingParams(kv_eviction="window", **params), use_tqdm=False)
    # 84 tokens cached (the last is sampled, never cached), compacted to 16 once a block (16) over
    cached = 77 + 8 - 1
    assert cached - 16 - 16 <= llm.engine.evicted_tokens["window"] <= cached - 16


def test_an_engine_that_cannot_evict_refuses_evicting_requests(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm(offload_memory="1MiB")
    with pytest.raises(ValueError, match="kv_eviction: .*offload"):
        llm.engine.add_request([1, 2, 3], SamplingParams(kv_eviction="window", kv_budget=16))
