"""Each policy keeps exactly what a plain-Python reference on the same positions and scores keeps,
per (layer, head), and compaction's moves leave exactly those positions in the first slots."""
from __future__ import annotations

import pytest
import torch

from kvserve.eviction import select
from kvserve.eviction.policy import EvictionPolicy
from kvserve.eviction.state import EvictionState


def reference_keep(policy: EvictionPolicy, positions: list[int], scores: list[float]) -> set[int]:
    """The positions one (layer, head) row keeps, written out from the policy's definition."""
    by_position = sorted(positions, reverse=True)
    score = dict(zip(positions, scores))
    if policy.name == "window":
        sinks = [p for p in positions if p < policy.sink_tokens]
        return set(sinks) | set([p for p in by_position if p >= policy.sink_tokens][:policy.budget - len(sinks)])
    if policy.name == "strided":
        sinks = [p for p in positions if p < policy.sink_tokens]
        recent = [p for p in by_position if p >= policy.sink_tokens][:policy.recent]
        older = [p for p in by_position if p not in sinks and p not in recent and p % policy.stride == 0]
        return set(sinks) | set(recent) | set(older[:policy.budget - len(sinks) - len(recent)])
    if policy.name == "tova":
        return set(sorted(positions, key=lambda p: -score[p])[:policy.budget])
    if policy.name == "h2o":
        recent = by_position[:policy.recent]
        end = max(positions) + 1  # a token at p was seen by the queries at p .. end - 1
        rest = sorted((p for p in positions if p not in recent), key=lambda p: -score[p] / (end - p))
        return set(recent) | set(rest[:policy.budget - policy.recent])
    if policy.name == "snapkv":
        w, k = policy.observation_window, policy.pooling_kernel
        recent = by_position[:w]
        ordered = sorted(positions)
        smooth = {}
        older = {q: 0.0 if q in recent else score[q] for q in ordered}  # the window is not pooled
        for i, p in enumerate(ordered):  # average over k neighbours, zeros past the ends (count_include_pad)
            smooth[p] = sum(older[q] for q in ordered[max(0, i - k // 2):i + k // 2 + 1]) / k
        rest = sorted((p for p in positions if p not in recent), key=lambda p: -smooth[p])
        return set(recent) | set(rest[:policy.budget - w])
    raise AssertionError(policy.name)


def shuffled_state(policy: EvictionPolicy, layers: int, heads: int, slots: int, seed: int) -> EvictionState:
    """Slots holding positions in a different order per row (as after earlier evictions), with
    random scores."""
    g = torch.Generator().manual_seed(seed)
    start = 3 if policy.name not in ("window", "strided") else 0  # keep the sinks for sink policies
    positions = torch.stack([torch.stack([torch.randperm(slots + 7, generator=g)[:slots].sort().values[
        torch.randperm(slots, generator=g)] + start for _ in range(heads)]) for _ in range(layers)])
    if policy.name in ("window", "strided"):  # sink and window policies are the same for every head
        order = torch.randperm(slots, generator=g)
        base = torch.cat([torch.arange(policy.sink_tokens), torch.randperm(3 * slots, generator=g)[
            :slots - policy.sink_tokens].sort().values + policy.sink_tokens])[order]
        positions = base.expand(layers, heads, slots).clone()
    scores = torch.rand(layers, heads, slots, generator=g)
    return EvictionState(policy, positions, scores, num_evicted=5, scored_queries=policy.observation_window)


POLICIES = [EvictionPolicy("window", 24), EvictionPolicy("window", 24, sink_tokens=0),
            EvictionPolicy("strided", 30, window=8, stride=3), EvictionPolicy("h2o", 24, window=6),
            EvictionPolicy("tova", 24), EvictionPolicy("snapkv", 24, observation_window=5, pooling_kernel=3),
            EvictionPolicy("snapkv", 24, observation_window=4, pooling_kernel=1)]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{p.name}-{p.budget}")
@pytest.mark.parametrize("seed", [0, 1])
def test_kept_equals_the_reference_per_head(policy: EvictionPolicy, seed: int) -> None:
    state = shuffled_state(policy, layers=3, heads=2, slots=40, seed=seed)
    keep = select.kept(policy, state.positions, state.scores)
    for layer in range(3):
        for head in range(2):
            pos = state.positions[layer, head].tolist()
            want = reference_keep(policy, pos, state.scores[layer, head].tolist())
            got = set(state.positions[layer, head][keep[layer, head]].tolist())
            assert got == want, (layer, head)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{p.name}-{p.budget}")
def test_compaction_moves_put_the_kept_positions_first(policy: EvictionPolicy) -> None:
    state = shuffled_state(policy, layers=2, heads=3, slots=37, seed=5)
    keep = select.kept(policy, state.positions, state.scores)
    moves, after = state.evicted()
    kept = int(keep[0, 0].sum())
    assert moves.kept == kept and after.num_slots == kept
    assert after.num_evicted == state.num_evicted + 37 - kept
    # Replay the moves on the slots' positions as the pool would on its pages.
    pages = state.positions.clone()
    pages[moves.layer, moves.head, moves.dst] = state.positions[moves.layer, moves.head, moves.src]
    for layer in range(2):
        for head in range(3):
            want = set(state.positions[layer, head][keep[layer, head]].tolist())
            assert set(pages[layer, head, :kept].tolist()) == want
            assert pages[layer, head, :kept].tolist() == after.positions[layer, head].tolist()
            # A slot's score travels with it.
            src_score = dict(zip(state.positions[layer, head].tolist(), state.scores[layer, head].tolist()))
            if policy.name != "snapkv":
                assert after.scores[layer, head].tolist() == [src_score[p] for p in after.positions[layer, head].tolist()]
    # Only dropped slots below the kept count are written: at most the evicted count per row.
    assert len(moves.dst) <= 2 * 3 * (37 - kept)


def test_due_waits_for_the_budget_and_snapkv_for_a_new_observation_window() -> None:
    window = EvictionState.empty(EvictionPolicy("window", 8), 1, 1)
    window.grow(8, None, 0)
    assert not window.due(8, 8, prompt_end=True)
    window.grow(9, None, 0)
    assert window.due(9, 8, prompt_end=False)
    snap = EvictionState.empty(EvictionPolicy("snapkv", 8, observation_window=3), 1, 1)
    snap.grow(12, torch.rand(1, 1, 12), 3)
    assert snap.due(12, 12, prompt_end=True)  # the prompt's end: first compaction
    _, snap = snap.evicted()
    for end in (9 + 4, 9 + 5):  # two decoded tokens: fewer queries than the window since
        snap.grow(end, torch.rand(1, 1, end - snap.num_evicted), 1)
        assert not snap.due(end, 12, prompt_end=False)
    snap.grow(9 + 6, torch.rand(1, 1, 15 - snap.num_evicted), 1)
    assert snap.due(15, 12, prompt_end=False)


def test_without_decode_eviction_only_the_prompt_end_evicts() -> None:
    once = EvictionState.empty(EvictionPolicy("h2o", 8, window=2, during_decode=False), 1, 1)
    once.grow(12, torch.rand(1, 1, 12), 12)
    assert once.due(12, 12, prompt_end=True)
    _, once = once.evicted()
    once.grow(13, torch.rand(1, 1, 9), 1)
    assert once.num_slots == 9 and not once.due(13, 12, prompt_end=False)


def test_within_a_prompt_only_chunk_ends_evict() -> None:
    whole = EvictionState.empty(EvictionPolicy("window", 8, sink_tokens=2), 1, 1)
    whole.grow(16, None, 0)
    assert not whole.due(16, 40, prompt_end=False)  # without prefill_chunk the prompt is judged whole
    chunked = EvictionPolicy("window", 8, sink_tokens=2, prefill_chunk=16)
    state = EvictionState.empty(chunked, 1, 1)
    state.grow(12, None, 0)
    assert not state.due(12, 40, prompt_end=False)  # the scheduler cut the chunk short: no chunk end
    state.grow(16, None, 0)
    assert state.due(16, 40, prompt_end=False)
    assert [chunked.prompt_stop(c, 40) for c in (0, 12, 16, 32, 39)] == [16, 16, 32, 40, 40]
    assert EvictionPolicy("window", 8).prompt_stop(12, 40) == 40


@pytest.mark.parametrize("policy", [EvictionPolicy("tova", 24, mean_heads=True),
                                    EvictionPolicy("h2o", 24, window=6, mean_heads=True),
                                    EvictionPolicy("snapkv", 24, observation_window=5, pooling_kernel=3,
                                                   mean_heads=True)], ids=lambda p: p.name)
def test_mean_heads_keeps_one_set_per_layer_by_the_head_averaged_scores(policy: EvictionPolicy) -> None:
    state = shuffled_state(policy, layers=2, heads=3, slots=40, seed=3)
    positions = state.positions[:, :1].expand_as(state.positions).clone()  # heads move alike in this mode
    keep = select.kept(policy, positions, state.scores)
    for layer in range(2):
        pos = positions[layer, 0].tolist()
        averaged = [sum(state.scores[layer, h, i].item() for h in range(3)) / 3 for i in range(40)]
        want = reference_keep(policy, pos, averaged)
        for head in range(3):
            assert set(positions[layer, head][keep[layer, head]].tolist()) == want, (layer, head)
    assert not (select.kept(EvictionPolicy(policy.name, 24, window=6, observation_window=5, pooling_kernel=3),
                            positions, state.scores) == keep).all()  # per head differs on these scores
