"""End-to-end engine behaviour on a tiny random model: modes agree, preemption, bad input."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvserve import LLM, SamplingParams

# Every test also runs in a pool that preempts (tests/conftest.py, forced_preemption).
pytestmark = pytest.mark.forced_preemption

PROMPTS = [[5, 9, 17, 3], list(range(1, 40)), [7] * 17, list(range(60, 93)), [11, 12], list(range(3, 19))]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def token_ids(llm: LLM, prompts: list[list[int]] = PROMPTS,
              params: SamplingParams | list[SamplingParams] = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("mode", ["no-cache", "contiguous"])
def test_cached_decoding_equals_baselines(tiny_llm: Callable[..., LLM], mode: str) -> None:
    assert token_ids(tiny_llm()) == token_ids(tiny_llm(cache_mode=mode))


def test_continuous_batching_equals_one_at_a_time(tiny_llm: Callable[..., LLM]) -> None:
    alone = [token_ids(tiny_llm(), [p])[0] for p in PROMPTS]
    llm = tiny_llm(max_num_seqs=2)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (5, 24, 9, 24, 3, 24)]
    outs = token_ids(llm, PROMPTS, params)
    assert outs == [a[:p.max_tokens] for a, p in zip(alone, params)]


def test_preemption_under_tiny_budget_keeps_outputs(tiny_llm: Callable[..., LLM]) -> None:
    reference = token_ids(tiny_llm())
    # 2 layers x 2 kv heads x 16 dims x 4 bytes x (K, V) = 512 bytes/token: 8 blocks of 16 tokens.
    small = tiny_llm(kv_cache_memory="64KiB")
    assert small.engine.block_manager.num_blocks == 8
    assert token_ids(small) == reference
    assert small.engine.scheduler.num_preemptions > 0


def test_contiguous_reserves_max_model_len(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm(cache_mode="contiguous", max_model_len=64)
    llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    llm.engine.step()
    assert llm.engine.kv_usage().used == 64 // 16
    while llm.engine.has_unfinished():
        llm.engine.step()


def test_seeded_sampling_is_batch_and_preemption_independent(tiny_llm: Callable[..., LLM]) -> None:
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = token_ids(tiny_llm(), [PROMPTS[1]], params)[0]
    others = [SamplingParams(max_tokens=20, temperature=0.8, seed=i, ignore_eos=True) for i in range(5)]
    batched = token_ids(tiny_llm(kv_cache_memory="64KiB"), PROMPTS, [others[0], params, *others[1:]])[1]
    assert batched == alone
    different_seed = token_ids(tiny_llm(), [PROMPTS[1]],
                               SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert different_seed != alone


def test_stop_token_ids_end_generation(tiny_llm: Callable[..., LLM]) -> None:
    full = token_ids(tiny_llm(), [PROMPTS[0]])[0]
    stop = full[5]
    out = tiny_llm().generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                            stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out.token_ids == full[:full.index(stop) + 1] and out.finish_reason == "stop"


def test_abort_frees_blocks(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm()
    rid = llm.engine.add_request(PROMPTS[1], GREEDY)
    llm.engine.step()
    assert llm.engine.kv_usage().used > 0
    llm.engine.abort(rid)
    assert llm.engine.kv_usage().used == 0 and not llm.engine.has_unfinished()


def test_stream_consumer_stopping_early_aborts(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm()
    stream = llm.stream(PROMPTS[:2], GREEDY)
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished()


def test_an_interrupted_generate_leaves_nothing_running(tiny_llm: Callable[..., LLM],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or an error) inside generate: its requests used to stay running, and the next call
    ran them to max_tokens first (or, after a failed step, spun on empty steps forever)."""
    llm = tiny_llm()
    step, calls = llm.engine.step, []

    def interrupted() -> list[Any]:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished() and llm.engine.kv_usage().used == 0
    assert token_ids(llm, PROMPTS[:1]) == token_ids(tiny_llm(), PROMPTS[:1])


def test_a_second_call_while_a_stream_is_open_is_refused(tiny_llm: Callable[..., LLM]) -> None:
    """Each call keeps only its own outputs from the steps it runs: two open at once used to hang."""
    llm = tiny_llm()
    stream = llm.stream(PROMPTS[:2], GREEDY)
    first = next(stream)
    with pytest.raises(RuntimeError, match="another generate\\(\\) or stream\\(\\)"):
        llm.generate(PROMPTS[2:3], GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="still running"):
        next(llm.stream(PROMPTS[2:3], GREEDY))
    finals = [o.token_ids for o in [first, *stream] if o.finished]
    assert finals == token_ids(tiny_llm(), PROMPTS[:2])  # the open stream was not disturbed
    assert token_ids(llm, PROMPTS[2:3]) == token_ids(tiny_llm(), PROMPTS[2:3])


@pytest.mark.parametrize("prompts, params, field", [
    (b"hi", GREEDY, "prompts"),  # used to run as the token ids [104, 105]
    ([b"hi"], GREEDY, "prompt"), ([bytearray(b"hi")], GREEDY, "prompt"),  # so did a list of them
    (None, GREEDY, "prompts"), (5, GREEDY, "prompts"),  # bare TypeErrors
    ([[1, 2]], {"max_tokens": 2}, "params"),  # "replace() should be called on dataclass instances"
])
def test_odd_offline_inputs_are_refused_naming_the_argument(tiny_llm: Callable[..., LLM], prompts: Any,
                                                            params: Any, field: str) -> None:
    llm = tiny_llm()
    with pytest.raises(ValueError, match=f"^{field}: must be"):
        llm.generate(prompts, params, use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_prompts_may_come_from_a_generator(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm()  # it used to fail: 'generator' object is not subscriptable
    assert token_ids(llm, (p for p in PROMPTS[:3])) == token_ids(llm, PROMPTS[:3])  # type: ignore[arg-type]


def test_final_output_kind_reports_each_sample_once_finished(tiny_llm: Callable[..., LLM]) -> None:
    engine = tiny_llm().engine
    params = [SamplingParams(max_tokens=m, temperature=t, seed=3, n=n, ignore_eos=True, output_kind=kind)
              for m, t, n in ((5, 0, 1), (12, 0.8, 2), (9, 0, 1)) for kind in ("cumulative", "final")]
    ids = [engine.add_request(PROMPTS[i // 2], p) for i, p in enumerate(params)]
    outputs: dict[str, list[Any]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    for rid, p, twin in zip(ids, params, ids[1:] + [None]):
        if p.output_kind == "final":
            assert len(outputs[rid]) == p.n and all(o.finished for o in outputs[rid])
        else:  # an output per token, and its final one equals that of the twin asking for final only
            assert len(outputs[rid]) == p.n * p.max_tokens
            last = {o.index: (o.token_ids, o.finish_reason) for o in outputs[rid] if o.finished}
            assert last == {o.index: (o.token_ids, o.finish_reason) for o in outputs[twin]}


@pytest.mark.model
@pytest.mark.parametrize("stop", [" and", "capital of"])  # one token; across tokens
def test_final_output_text_equals_the_streamed_text(smol: LLM, stop: str) -> None:
    """The streamed deltas add up to the final text: a stop string is never shown, even where
    its first tokens were streamed before the last one completed it."""
    prompt = "The three largest cities of France are"
    params = SamplingParams(max_tokens=40, temperature=0, stop=[stop])
    streamed = list(smol.stream(prompt, params))
    final = smol.generate(prompt, params, use_tqdm=False)[0]
    assert final.text == streamed[-1].text == "".join(o.delta_text for o in streamed) == final.delta_text
    assert final.token_ids == streamed[-1].token_ids and final.finish_reason == "stop"


def test_bad_input_is_rejected_without_disturbing_running_requests(tiny_llm: Callable[..., LLM]) -> None:
    reference = token_ids(tiny_llm(), PROMPTS[:3])
    llm = tiny_llm()
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:3]]
    engine.step()
    engine.step()
    bad = [
        (lambda: engine.add_request([], GREEDY), "empty prompt"),
        (lambda: engine.add_request(list(range(1, 100)) * 3, GREEDY), "max_model_len"),
        (lambda: engine.add_request([1, 2], SamplingParams(max_tokens=255)), "max_model_len"),
        (lambda: engine.add_request([1, 999], GREEDY), "token ids"),
        (lambda: engine.add_request("text", GREEDY), "no tokenizer"),
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
        # Found by a hostile tester: each once crashed the batch or was silently accepted.
        (lambda: engine.add_request([1, 2.5], GREEDY), "prompt: token ids must be integers"),
        (lambda: engine.add_request([True, False], GREEDY), "prompt: token ids must be integers"),
        (lambda: engine.add_request(7, GREEDY), "prompt: must be a string or a list"),
        (lambda: SamplingParams(temperature=float("nan")), "temperature"),
        (lambda: SamplingParams(temperature="0.5"), "temperature"),  # type: ignore[arg-type]
        (lambda: SamplingParams(top_k=1.5), "top_k"),  # type: ignore[arg-type]
        (lambda: SamplingParams(seed=True), "seed"),
        (lambda: SamplingParams(stop_token_ids=[2.0]), "stop_token_ids"),  # type: ignore[list-item]
        (lambda: SamplingParams(output_kind="delta"), "SamplingParams.output_kind"),
        (lambda: engine.add_request([1, 2], {"max_tokens": 3}), "params: must be SamplingParams"),  # type: ignore[arg-type]
    ]
    for call, message in bad:
        with pytest.raises(ValueError, match=message):
            call()
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert [outputs[i] for i in ids] == reference


def test_request_larger_than_kv_budget_is_rejected(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm(kv_cache_memory="32KiB")  # 4 blocks = 64 tokens
    with pytest.raises(ValueError, match="whole KV cache"):
        llm.engine.add_request(list(range(1, 50)), SamplingParams(max_tokens=30))


def test_generate_rejects_all_when_one_prompt_is_empty(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm()
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[1, 2], []], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("bad", [[1, 2.5], [True, False]])
def test_engine_survives_a_batch_with_a_non_integer_token(tiny_llm: Callable[..., LLM], bad: list[Any]) -> None:
    """Once, a float or bool id passed validation, crashed the batch and left 4 blocks held, and
    every later call failed the same way."""
    llm = tiny_llm()
    with pytest.raises(ValueError, match="token ids must be integers"):
        llm.generate([[1, 2, 3], bad], GREEDY, use_tqdm=False)
    assert llm.engine.kv_usage().used == 0 and not llm.engine.has_unfinished()
    assert token_ids(llm, PROMPTS[:2]) == token_ids(tiny_llm(), PROMPTS[:2])


def test_bad_engine_config_errors(tiny_llm: Callable[..., LLM]) -> None:
    with pytest.raises(ValueError, match="smaller than one KV block"):
        tiny_llm(kv_cache_memory="1KiB")
    with pytest.raises(FileNotFoundError, match="no such file"):
        LLM(model="/nonexistent/model.gguf")
    with pytest.raises(ValueError, match="contiguous"):
        tiny_llm(cache_mode="contiguous", kv_cache_memory="64KiB")


def test_prefix_caching_same_outputs_fewer_tokens_computed(tiny_llm: Callable[..., LLM]) -> None:
    system = list(range(20, 70))  # a 50-token shared "system prompt": 3 full blocks
    prompts = [system + [i, i + 1, i + 2] for i in range(1, 8)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    runs = {}
    for enabled in (True, False):
        llm = tiny_llm(enable_prefix_caching=enabled, max_num_seqs=2)
        runs[enabled] = (token_ids(llm, prompts, params), llm.engine.tokens_computed,
                         llm.engine.block_manager.prefix_stats.hit_rate)
    assert runs[True][0] == runs[False][0]
    # The first two requests are prefilled together, before anything is cached; the other five
    # each reuse the system prompt's 3 full blocks (48 tokens).
    assert runs[True][2] == pytest.approx(5 * 48 / (7 * 53))
    assert runs[True][1] == runs[False][1] - 5 * 48
    assert runs[False][2] == 0


def test_preempted_sequence_resumes_from_its_cached_blocks(tiny_llm: Callable[..., LLM]) -> None:
    reference = token_ids(tiny_llm())
    small = tiny_llm(kv_cache_memory="64KiB")
    assert token_ids(small) == reference
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.block_manager.prefix_stats.cached_tokens > 0


def test_n_samples_equal_separate_seeded_requests_with_fewer_blocks(tiny_llm: Callable[..., LLM]) -> None:
    prompt = list(range(1, 41))  # 2 full blocks + 8 tokens in a shared partial block
    base = dict(max_tokens=20, temperature=1.0, top_k=50, ignore_eos=True)
    shared = tiny_llm()
    outs = shared.generate([prompt], SamplingParams(n=4, seed=7, **base), use_tqdm=False)
    assert [o.index for o in outs] == [0, 1, 2, 3]
    separate = tiny_llm(enable_prefix_caching=False)
    expected = separate.generate([prompt] * 4, [SamplingParams(seed=7 + i, **base) for i in range(4)],
                                 use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert len({tuple(o.token_ids) for o in outs}) > 1  # the samples really differ
    # Without sharing: 4 x ceil(60 / 16) = 16 blocks. Shared: 2 prompt blocks + 4 x 2 own blocks.
    assert separate.engine.block_manager.peak_used == 16
    assert shared.engine.block_manager.peak_used == 10


def test_sharing_saving_is_reported_while_samples_run(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm()
    llm.engine.add_request(list(range(1, 41)), SamplingParams(n=3, max_tokens=5, temperature=0))
    llm.engine.step()  # prefill, then fork
    usage = llm.engine.kv_usage()
    assert (usage.used, usage.unshared_blocks) == (3, 9)
    llm.engine.abort("0")
    assert llm.engine.kv_usage().used == 0


def test_forked_samples_count_against_max_num_seqs(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm(max_num_seqs=4)
    engine = llm.engine
    for prompt in PROMPTS[:3]:
        engine.add_request(prompt, SamplingParams(n=2, max_tokens=6, temperature=0.5, seed=1))
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, len(engine.scheduler.running))
    assert most == 4


def test_cache_salt_keeps_tenants_prefix_hits_apart(tiny_llm: Callable[..., LLM]) -> None:
    """The prefix-hit side channel: one tenant must not learn from hits what another sent."""
    llm = tiny_llm()
    engine = llm.engine
    prompt = list(range(1, 70))  # 4 full blocks of 16

    def cached_by(salt: str | None) -> int:
        before = engine.block_manager.prefix_stats.cached_tokens
        engine.add_request(prompt, SamplingParams(max_tokens=2), cache_salt=salt)
        while engine.has_unfinished():
            engine.step()
        return engine.block_manager.prefix_stats.cached_tokens - before

    assert cached_by("tenant-a") == 0
    assert cached_by("tenant-b") == 0 and cached_by(None) == 0  # another salt, or none: no hit
    assert cached_by("tenant-a") == 64 and cached_by(None) == 64  # each within its own salt
    before = engine.block_manager.prefix_stats.cached_tokens
    llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False, cache_salt="tenant-b")  # the offline API
    assert engine.block_manager.prefix_stats.cached_tokens - before == 64
    for bad in ("", "tenant-\ud800"):  # a lone surrogate used to fail every later step
        with pytest.raises(ValueError, match="cache_salt"):
            engine.add_request(prompt, SamplingParams(max_tokens=2), cache_salt=bad)
    assert not engine.has_unfinished() and cached_by("tenant-a") == 64


@pytest.mark.roomy
def test_outputs_count_the_prompt_tokens_a_cache_served(tiny_llm: Callable[..., LLM]) -> None:
    """num_cached_tokens: a prompt's full blocks the prefix cache held at its first admission (the
    last prompt token is always computed); every sample of the request reports its own prompt's."""
    llm = tiny_llm(block_size=16)
    prompt = [(3 * i + 1) % 120 + 4 for i in range(50)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0
    again = llm.generate(prompt + [9], SamplingParams(max_tokens=4, temperature=0.5, n=2, seed=1),
                         use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [48, 48]  # 3 full blocks of the 50 tokens run before
    assert llm.generate(prompt[:20], params, use_tqdm=False)[0].num_cached_tokens == 16
