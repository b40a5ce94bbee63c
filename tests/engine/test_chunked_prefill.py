"""Chunked prefill through the whole engine: same tokens as whole-prompt prefill, and running
streams are never stalled by a prompt."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.scheduler import SchedulerOutput

# Every test also runs in a pool that preempts (tests/conftest.py, forced_preemption).
pytestmark = pytest.mark.forced_preemption

PROMPTS = [[(5 * i + 3 * j) % 120 + 1 for j in range(n)] for i, n in enumerate([9, 150, 40, 3, 97])]


def record_steps(llm: LLM) -> list[tuple[SchedulerOutput, list[int]]]:
    """(schedule, remaining tokens of each scheduled sequence before the step) per engine step."""
    scheduler = llm.engine.scheduler
    steps: list[tuple[SchedulerOutput, list[int]]] = []
    schedule = scheduler.schedule

    def recording() -> SchedulerOutput:
        out = schedule()
        steps.append((out, [s.num_new_tokens for s in out.seqs]))
        return out

    scheduler.schedule = recording  # type: ignore[method-assign]
    return steps


@pytest.mark.roomy  # its beam group needs two sequences' blocks at once
@pytest.mark.parametrize("budget", [8, 33])
def test_same_tokens_as_whole_prompt_prefill(tiny_llm: Callable[..., LLM], budget: int) -> None:
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=i, ignore_eos=True) for i in range(5)]
    params[1] = SamplingParams(max_tokens=12, beam_width=2, ignore_eos=True)
    params[2] = SamplingParams(max_tokens=15, n=2, temperature=1.0, seed=4, ignore_eos=True)
    whole = tiny_llm(enable_chunked_prefill=False, max_num_seqs=6)
    chunked = tiny_llm(max_num_batched_tokens=budget, max_num_seqs=6)
    steps = record_steps(chunked)
    want = [o.token_ids for o in whole.generate(PROMPTS, params, use_tqdm=False)]
    assert [o.token_ids for o in chunked.generate(PROMPTS, params, use_tqdm=False)] == want
    assert any(n < remaining for out, before in steps for n, remaining in zip(out.num_scheduled, before))


def test_running_sequences_decode_in_every_step_with_a_prefill_chunk(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm(max_num_batched_tokens=16, max_num_seqs=8)
    steps = record_steps(llm)
    engine = llm.engine
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine.add_request(PROMPTS[0], params)
    engine.add_request(PROMPTS[3], params)
    produced: list[set[str]] = []
    for i in range(60):
        if i == 3:  # two streams are decoding; a 150-token prompt arrives
            engine.add_request(PROMPTS[1], params, request_id="long")
        produced.append({o.request_id for o in engine.step()})
        if not engine.has_unfinished():
            break
    chunk_steps = 0
    for (out, before), got in zip(steps, produced):
        decoding = [s.request_id for s, r in zip(out.seqs, before) if r == 1]
        if any(r > 1 for r in before):
            chunk_steps += 1
            assert out.num_tokens <= 16
            assert set(decoding) <= got  # every running stream got its token in this step
    assert chunk_steps >= 150 // 16  # the long prompt really was cut into chunks


@pytest.mark.model
def test_real_model_chunked_equals_whole_prefill(smol: LLM) -> None:
    prompts = ["Once upon a time, in a quiet village at the edge of a great forest, there lived",
               "The three primary colors are", "def quicksort(items):"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    chunked = LLM(dtype="float32", device="cpu", kv_cache_memory="64MiB", max_model_len=512,
                  max_num_batched_tokens=8, max_num_seqs=4)
    whole = smol.generate(prompts, params, use_tqdm=False)
    assert smol.engine.scheduler.chunked_prefill and smol.engine.scheduler.max_num_batched_tokens >= max(len(smol.tokenizer.encode(p)) for p in prompts)
    assert [o.token_ids for o in chunked.generate(prompts, params, use_tqdm=False)] == [o.token_ids for o in whole]
