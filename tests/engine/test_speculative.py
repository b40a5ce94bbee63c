"""Speculative decoding (n-gram drafts) against the same engine without it: the same tokens,
greedy and seeded, under every feature it combines with, and no trace of a rejected draft token
in any cache (issue 44). The tiny random model repeats itself, so its n-gram drafts are both
accepted and rejected; each test checks that both happened."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cache.blocks import on_device

from tests.conftest import RedisServer

pytestmark = pytest.mark.forced_preemption

BASE = [17, 93, 5, 61, 40, 88, 23, 70, 9, 112, 54, 31]
PROMPTS = [BASE * 4, [5, 6, 7, 8] * 10, [(7 * i * i + 3 * i + 1) % 120 + 4 for i in range(40)]]
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=40, temperature=0.3, top_p=0.95, seed=5, ignore_eos=True)
SPEC = dict(speculative="ngram", prompt_lookup_min=1, prompt_lookup_max=3, num_speculative_tokens=4)


def tokens(llm: LLM, params: SamplingParams, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_drafts_judged(llm: LLM) -> None:
    """Some drafts won tokens and some lost them: both paths of verification ran."""
    stats = llm.engine.update.verifier.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens, stats


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("options", [
    {},
    {"enable_prefix_caching": False},
    {"enable_chunked_prefill": False},
    {"max_num_batched_tokens": 6, "max_num_seqs": 3},  # drafts cut to what the token budget leaves
    {"block_size": 4},                      # drafts span blocks; rollback frees whole ones
    {"num_speculative_tokens": 1},
    {"kv_cache_dtype": "int8", "kv_residual": 0},   # codes written token by token, as dense pages
    {"kv_cache_dtype": "fp8_e4m3", "kv_fp8_scales": "head"},
    {"kv_cache_dtype": "int4", "kv_residual": 0, "kv_group_size": 16, "block_size": 4},
    {"offload_memory": "1MiB", "kv_cache_memory": "64KiB", "max_model_len": 256},
], ids=["default", "no-prefix-cache", "whole-prefill", "small-budget", "block-4", "one-token-drafts", "int8", "fp8-head",
        "int4", "offload"])
def test_same_tokens_as_without_speculation(tiny_llm: Callable[..., LLM], params: SamplingParams,
                                            options: dict[str, Any]) -> None:
    reference = tokens(tiny_llm(**{k: v for k, v in options.items() if k not in SPEC}), params)
    llm = tiny_llm(**{**SPEC, **options})
    assert tokens(llm, params) == reference
    assert_drafts_judged(llm)


def test_prefix_hits_and_n_samples(tiny_llm: Callable[..., LLM]) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.7, seed=3, n=3, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[0] + [3], PROMPTS[1]]  # the second hits the first's blocks

    def run(llm: LLM) -> list[list[list[int]]]:
        return [[o.token_ids for o in llm.generate([p], params, use_tqdm=False)] for p in prompts]

    reference = run(tiny_llm())
    llm = tiny_llm(**SPEC)
    assert run(llm) == reference
    assert_drafts_judged(llm)


@pytest.mark.roomy
def test_preemption_by_swap(tiny_llm: Callable[..., LLM]) -> None:
    pool = dict(kv_cache_memory="64KiB", enable_prefix_caching=False, max_num_seqs=3,
                speculative_disable_by_batch_size=8)
    reference = tokens(tiny_llm(**pool), GREEDY)
    llm = tiny_llm(preemption_mode="swap", host_swap_memory="1MiB", **pool, **SPEC)
    assert tokens(llm, GREEDY) == reference
    assert llm.engine.scheduler.preemptions["swap"] > 0
    assert_drafts_judged(llm)


@pytest.mark.roomy
def test_a_request_with_n_samples_forks_before_it_drafts(tiny_llm: Callable[..., LLM]) -> None:
    """A prompt whose last token runs alone (a chunk boundary) is scheduled as a decode; a request
    with n samples forks when that token's output is sampled, so it must not draft then (found by
    review: the samples copied the parent's first token, or were never made)."""
    found = [21, 76, 112, 106, 101, 12, 36, 19, 67, 101, 61, 64, 87, 52, 104, 30, 16, 22, 16]
    prompts = [list(range(30, 44)), found]
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.9, seed=1, n=3, ignore_eos=True)]
    for options, ps in (({"max_num_batched_tokens": 32}, params),
                        ({"max_num_batched_tokens": 3, "max_num_seqs": 3},
                         [SamplingParams(max_tokens=2, temperature=0, n=3, ignore_eos=True)])):
        batch = prompts if len(ps) == 2 else prompts[1:]
        want = [o.token_ids for o in tiny_llm(**options).generate(batch, ps, use_tqdm=False)]
        got = [o.token_ids for o in tiny_llm(**options, **SPEC).generate(batch, ps, use_tqdm=False)]
        assert got == want


def test_requests_that_cannot_speculate_decode_beside_those_that_do(tiny_llm: Callable[..., LLM]) -> None:
    """Logprobs, penalties, beams and a request's own eviction policy take the ordinary path in the
    same steps."""
    others = [SamplingParams(max_tokens=20, temperature=0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0, beam_width=2, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0, kv_eviction="window", kv_budget=24, ignore_eos=True)]

    def run(llm: LLM) -> list[list[int]]:
        return [o.token_ids for o in llm.generate(PROMPTS[:2] + PROMPTS[:2] + PROMPTS[1:], [GREEDY, GREEDY, *others],
                                                  use_tqdm=False)]

    reference = run(tiny_llm())
    llm = tiny_llm(**SPEC)
    assert run(llm) == reference
    assert_drafts_judged(llm)


def test_stops_inside_an_accepted_draft(tiny_llm: Callable[..., LLM]) -> None:
    """A stop token or max_tokens reached within a step's accepted tokens ends the output there."""
    reference = tiny_llm().generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].token_ids
    stop = reference[len(reference) // 2]
    for params in (SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop], ignore_eos=True),
                   SamplingParams(max_tokens=13, temperature=0, ignore_eos=True)):
        want = tiny_llm().generate(PROMPTS[1], params, use_tqdm=False)[0]
        got = tiny_llm(**SPEC).generate(PROMPTS[1], params, use_tqdm=False)[0]
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)


@pytest.mark.roomy
@pytest.mark.parametrize("pages", [{}, {"kv_cache_dtype": "int8", "kv_residual": 0}], ids=["dense", "int8"])
def test_a_rejected_token_leaves_no_trace(tiny_llm: Callable[..., LLM], pages: dict[str, Any]) -> None:
    """Step by step: each sequence's tables hold exactly its tokens' blocks (rejected slots given
    back), nothing else is in use; afterwards every prefix-cache block holds tokens of the final
    outputs, and its pages equal those the run without speculation cached under the same hash."""
    plain = tiny_llm(block_size=4, **pages)
    plain.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = tiny_llm(block_size=4, **SPEC, **pages)
    engine, bm = llm.engine, llm.engine.block_manager
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    final: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.prompt_token_ids + out.token_ids
        running = engine.scheduler.running
        for seq in running:  # nothing past its tokens (the next step's slot may still be to take)
            assert bm.blocks_for(seq.num_computed_tokens) <= len(bm.tables[seq.seq_id]) <= \
                bm.blocks_for(seq.num_tokens)
            assert bm.num_tokens[seq.seq_id] <= seq.num_tokens
        assert bm.usage().used == len({b for s in running for b in bm.tables[s.seq_id]})
    assert_drafts_judged(llm)
    chunks = {tuple(seq[i:i + 4]) for seq in final.values() for i in range(0, len(seq) - 3, 4)}
    cached = {bm.blocks[b].token_ids for b in bm.cache.values()}
    assert cached and cached <= chunks
    plain_bm = plain.engine.block_manager
    shared = set(bm.cache) & set(plain_bm.cache)
    assert len(shared) == len(bm.cache)
    for h in shared:
        for ours, theirs in zip(engine.pool.block_tensors, plain.engine.pool.block_tensors):
            torch.testing.assert_close(ours[bm.cache[h]], theirs[plain_bm.cache[h]], rtol=1e-5, atol=1e-6)
    assert len(ids) == len(final)


@pytest.mark.roomy
def test_the_remote_tier_sees_accepted_blocks_only(tiny_llm: Callable[..., LLM], redis_server: RedisServer) -> None:
    reference = tiny_llm(kv_remote=redis_server.url, block_size=4)
    reference.generate(PROMPTS, GREEDY, use_tqdm=False)
    stored = reference.engine.remote.stats.stored
    redis_server.stop()
    redis_server.start()
    llm = tiny_llm(kv_remote=redis_server.url, block_size=4, **SPEC)
    assert tokens(llm, GREEDY) == tokens(tiny_llm(block_size=4), GREEDY)
    assert llm.engine.remote.stats.stored == stored
    assert_drafts_judged(llm)


@pytest.mark.parametrize("options, field", [
    ({"kv_cache_dtype": "kivi4"}, "speculative"),
    ({"kv_cache_dtype": "int8", "kv_residual": 16}, "speculative"),
    ({"kv_eviction": "window", "kv_budget": 64}, "speculative"),
    ({"cache_mode": "contiguous"}, "speculative"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
])
def test_combinations_not_built_are_refused(tiny_llm: Callable[..., LLM], options: dict[str, Any],
                                            field: str) -> None:
    with pytest.raises(ValueError, match=field) as err:
        tiny_llm(**{**SPEC, **options})
    assert getattr(err.value, "field", field) == field


def test_drafts_skip_a_batch_at_the_size_limit(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm(**SPEC, speculative_disable_by_batch_size=2)
    assert tokens(llm, GREEDY, PROMPTS[:2]) == tokens(tiny_llm(), GREEDY, PROMPTS[:2])
    assert llm.engine.update.verifier.stats.drafts == 0


def test_metrics_count_what_the_verifier_judged(tiny_llm: Callable[..., LLM]) -> None:
    """/metrics' counters against the verifier's own totals, and the acceptance histogram against
    the drafts it counts: every draft is in one bucket."""
    from kvserve.server.metrics import Metrics

    llm = tiny_llm(**SPEC)
    metrics = Metrics()
    tokens(llm, GREEDY)
    metrics.observe_step(llm.engine)
    text = metrics.render().decode()
    stats = llm.engine.update.verifier.stats
    for event, value in (("drafts", stats.drafts), ("draft_tokens", stats.draft_tokens),
                         ("accepted_tokens", stats.accepted_tokens)):
        assert f'kvserve_spec_decode_tokens_total{{event="{event}"}} {float(value)}' in text
    buckets = {int(k): v for k, v in stats.accepted_lengths.items()}
    assert sum(buckets.values()) == stats.drafts and sum(k * v for k, v in buckets.items()) == stats.accepted_tokens
    for accepted, count in buckets.items():
        assert f'kvserve_spec_decode_drafts_by_accepted_length_total{{accepted="{accepted}"}} {float(count)}' in text
