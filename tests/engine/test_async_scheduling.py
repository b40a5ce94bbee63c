"""Async scheduling: a step launched before the host reads the step before's tokens gives the
same outputs as stepping synchronously, in every mode, and leaves no block or placeholder."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvserve import LLM, EngineConfig, SamplingParams
from kvserve.engine.model_runner import StepResult
from kvserve.engine.sequence import PLACEHOLDER, RequestOutput
from kvserve.engine.step_plan import StepPlan

from tests.backend_cases import backend_device
from tests.engine.test_llm_engine import PROMPTS

# Every test also runs in a pool that preempts (tests/conftest.py, forced_preemption).
pytestmark = pytest.mark.forced_preemption


def count_overlapped_steps(llm: LLM) -> list[int]:
    """A one-item list counting the steps the runner ran while the host had not read the step
    before's tokens (the runner took them on the device)."""
    runner = llm.engine.runner
    forward = runner.forward
    counted = [0]

    def counting(plan: StepPlan) -> StepResult:
        counted[0] += plan.fill is not None
        return forward(plan)

    runner.forward = counting  # type: ignore[method-assign]
    return counted


def run(llm: LLM, params: list[SamplingParams]) -> list[tuple[list[int], str | None]]:
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(PLACEHOLDER not in o.token_ids for o in outs)
    return [(o.token_ids, o.finish_reason) for o in outs]


def stopping_params(reference: LLM) -> list[SamplingParams]:
    """Greedy and seeded requests that end early on a token of their own output (found by a
    first run), at max_tokens, or at the context length (or the pool's size)."""
    free = [SamplingParams(max_tokens=24, temperature=t, seed=i, ignore_eos=True)
            for i, t in enumerate([0, 0.9, 0, 0.7, 0, 1.0])]
    outs = reference.generate(PROMPTS, free, use_tqdm=False)
    params = [SamplingParams(max_tokens=24, temperature=p.temperature, seed=p.seed, ignore_eos=True,
                             stop_token_ids=[o.token_ids[3 + i]]) for i, (p, o) in enumerate(zip(free, outs))]
    params[4] = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    bm = reference.engine.block_manager
    room = min(reference.engine.max_model_len, bm.num_blocks * bm.block_size)
    # Two that fill the context (or the pool) together: a small pool must preempt one.
    params[1] = SamplingParams(max_tokens=room - len(PROMPTS[1]), temperature=0.9, seed=1, ignore_eos=True)
    params[5] = SamplingParams(max_tokens=room - len(PROMPTS[5]), temperature=0.8, seed=5, ignore_eos=True)
    return params


@pytest.mark.parametrize("options", [
    {},
    {"enable_chunked_prefill": False},
    {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    {"cache_mode": "no-cache"},
    {"cache_mode": "contiguous", "kv_cache_memory": "1MiB"},
    {"kv_cache_memory": "64KiB", "enable_prefix_caching": False},  # preempts by recompute
    {"kv_cache_memory": "64KiB", "preemption_mode": "swap", "host_swap_memory": "1MiB"},
], ids=["chunked", "prefill-first", "small-budget", "no-cache", "contiguous", "recompute", "swap"])
def test_same_outputs_as_synchronous_steps(tiny_llm: Callable[..., LLM], options: dict[str, Any]) -> None:
    sync = tiny_llm(async_scheduling="off", **options)
    params = stopping_params(sync)
    want = run(sync, params)
    assert {reason for _, reason in want} == {"stop", "length"}
    llm = tiny_llm(async_scheduling="on", **options)
    overlapped = count_overlapped_steps(llm)
    assert run(llm, params) == want
    assert overlapped[0] > 10
    if options.get("kv_cache_memory") == "64KiB":  # the pool is small enough to preempt
        assert llm.engine.scheduler.num_preemptions > 0


def test_same_outputs_with_the_triton_backend(tiny_llm: Callable[..., LLM]) -> None:
    """The GPU's backend (interpreted here): its tiles come from the step's metadata, whose input
    ids the runner takes from the device."""
    params = [SamplingParams(max_tokens=6, temperature=t, seed=i, ignore_eos=True) for i, t in enumerate([0, 0.8, 0])]
    sync = tiny_llm(async_scheduling="off", attention_backend="triton", device=backend_device("triton"),
                   max_num_batched_tokens=16, max_num_seqs=4)
    want = [o.token_ids for o in sync.generate(PROMPTS[:3], params, use_tqdm=False)]
    llm = tiny_llm(async_scheduling="on", attention_backend="triton", device=backend_device("triton"),
                   max_num_batched_tokens=16, max_num_seqs=4)
    overlapped = count_overlapped_steps(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)] == want
    assert overlapped[0] >= 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_same_outputs_on_cuda_with_graphs(tiny_llm: Callable[..., LLM]) -> None:
    """Where async scheduling is on by default: the step before's tokens are taken on the device
    by the graphed decode steps and by the eager mixed ones."""
    options = dict(device="cuda", attention_backend="triton", max_num_seqs=6, max_num_batched_tokens=32)
    sync = tiny_llm(async_scheduling="off", **options)
    params = stopping_params(sync)
    want = run(sync, params)
    llm = tiny_llm(**options)
    assert llm.engine.async_scheduling and llm.engine.runner.graphs is not None
    overlapped = count_overlapped_steps(llm)
    assert run(llm, params) == want and overlapped[0] > 10


def test_requests_that_need_their_token_at_once_step_synchronously_beside_others(
        tiny_llm: Callable[..., LLM]) -> None:
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, logprobs=2, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, n=2, temperature=1.0, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=12, beam_width=2, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, seed=2, presence_penalty=1.5, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True)]

    def outputs(llm: LLM) -> list[tuple[list[int], Any]]:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [(o.token_ids, None if o.logprobs is None else [lp.top for lp in o.logprobs]) for o in outs]

    want = outputs(tiny_llm(async_scheduling="off", max_num_seqs=8))
    llm = tiny_llm(async_scheduling="on", max_num_seqs=8)
    assert outputs(llm) == want
    # A step overlaps when all its sequences may: here once only the plain requests run on.
    overlapped = count_overlapped_steps(llm)
    assert outputs(llm) == want and overlapped[0] > 0


def test_a_sequence_whose_pending_token_is_its_last_runs_no_further_step(tiny_llm: Callable[..., LLM]) -> None:
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (1, 5, 9, 2, 14, 3)]
    sync, overlapped = tiny_llm(async_scheduling="off"), tiny_llm(async_scheduling="on")
    assert run(overlapped, params) == run(sync, params)
    # Each request computes its prompt and every output but the last, as when stepped synchronously.
    assert overlapped.engine.tokens_computed == sync.engine.tokens_computed == \
        sum(len(p) + sp.max_tokens - 1 for p, sp in zip(PROMPTS, params))


def test_a_step_that_runs_no_sequence_still_moves_its_blocks(tiny_llm: Callable[..., LLM]) -> None:
    """The one sequence that could run is preempted by swap while the other awaits its last
    token: the step runs nothing, but its swap-out must be copied, or the sequence comes back
    over pages never written."""
    options = dict(kv_cache_memory="64KiB", enable_prefix_caching=False, preemption_mode="swap",
                   host_swap_memory="1MiB", max_num_seqs=2)
    prompts = [[(7 * i + 3) % 120 + 1 for i in range(60)], [(5 * i + 11) % 120 + 1 for i in range(60)]]
    params = [SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)]
    sync = tiny_llm(async_scheduling="off", **options)
    want = [o.token_ids for o in sync.generate(prompts, params, use_tqdm=False)]
    llm = tiny_llm(async_scheduling="on", **options)
    runner = llm.engine.runner
    move_blocks, moved = runner.move_blocks, []
    runner.move_blocks = lambda ops: (moved.append(ops), move_blocks(ops))[1]  # type: ignore[method-assign]
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert any(ops.swap_out for ops in moved)  # the case this test is for happened


def test_abort_while_a_token_is_pending(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm(async_scheduling="on")
    engine = llm.engine
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    keep = engine.add_request(PROMPTS[1], params)
    dropped = engine.add_request(PROMPTS[2], params)
    seen: list[RequestOutput] = []
    for _ in range(6):
        seen += engine.step()
    pending = next(s for s in engine.scheduler.running if s.request_id == dropped)
    assert pending.output_token_ids[-1] == PLACEHOLDER  # its token is on its way
    engine.abort(dropped)
    assert PLACEHOLDER not in pending.output_token_ids and pending.out.finish_reason == "abort"
    while engine.has_unfinished():
        seen += engine.step()
    final = [o for o in seen if o.request_id == keep and o.finished]
    alone = tiny_llm(async_scheduling="off").generate([PROMPTS[1]], params, use_tqdm=False)[0]
    assert len(final) == 1 and final[0].token_ids == alone.token_ids
    assert all(o.request_id == keep for o in seen[-3:])  # nothing came back for the aborted one


def test_a_request_sent_again_under_an_aborted_id_gets_its_own_tokens(tiny_llm: Callable[..., LLM]) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = tiny_llm(async_scheduling="off").generate([PROMPTS[3]], params, use_tqdm=False)[0].token_ids
    engine = tiny_llm(async_scheduling="on").engine
    engine.add_request(PROMPTS[1], params, request_id="x")
    for _ in range(4):
        engine.step()
    engine.abort("x")  # its last token is still pending
    engine.add_request(PROMPTS[3], params, request_id="x")
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert [o.token_ids for o in outs] == [want]


def test_a_failed_step_keeps_the_pending_tokens(tiny_llm: Callable[..., LLM]) -> None:
    """A step whose forward pass raises leaves the engine as it was: the next step runs the same
    sequences, the step before's tokens still taken from the device."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in tiny_llm(async_scheduling="off").generate(PROMPTS[:3], params, use_tqdm=False)]
    llm = tiny_llm(async_scheduling="on")
    engine, execute = llm.engine, llm.engine.runner.execute
    calls = [0]

    def failing_once(step: Any) -> Any:
        calls[0] += 1
        if calls[0] == 6:
            raise RuntimeError("device fault")
        return execute(step)

    engine.runner.execute = failing_once  # type: ignore[method-assign]
    ids = [engine.add_request(p, params) for p in PROMPTS[:3]]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        try:
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        except RuntimeError as err:
            assert str(err) == "device fault"
    assert calls[0] > 6 and [done[i] for i in ids] == want


def test_stream_stopped_early_leaves_no_block(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm(async_scheduling="on")
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i, out in enumerate(llm.stream(PROMPTS[:3], params)):
        assert PLACEHOLDER not in out.token_ids
        if i == 10:
            break
    assert not llm.engine.has_unfinished()  # tiny_llm checks every block came back


def test_auto_is_off_on_a_cpu(tiny_llm: Callable[..., LLM]) -> None:
    assert not tiny_llm().engine.async_scheduling
    assert tiny_llm(async_scheduling="on").engine.async_scheduling


@pytest.mark.parametrize("kwargs, owner, field", [
    ({"async_scheduling": "yes"}, "SchedulerOptions", "async_scheduling"),
    ({"async_scheduling": "on", "tensor_parallel_size": 2}, "EngineConfig", "tensor_parallel_size"),
])
def test_bad_option_names_its_field(kwargs: dict[str, Any], owner: str, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{owner}.{field}"):
        EngineConfig.of(device="cpu", **kwargs)
