"""SamplingParams.logprobs and forced_token_ids: the numbers a scoring client gets back."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams

from tests.conftest import TINY

# Every test also runs in a pool that preempts (tests/conftest.py, forced_preemption).
pytestmark = pytest.mark.forced_preemption

PROMPTS = [[5, 9, 2, 7, 7, 1], [3, 3, 8, 100, 4, 4, 4, 4, 61, 2]]
FORCED = [[17, 3, 99, 4, 4, 120, 6, 1], [2, 2, 2, 50, 0, 9, 8, 77]]


def forced(llm: LLM, logprobs: int, temperature: float = 0.0) -> list[Any]:
    params = [SamplingParams(max_tokens=len(f), temperature=temperature, seed=1, ignore_eos=True,
                             logprobs=logprobs, forced_token_ids=f) for f in FORCED]
    return llm.generate(PROMPTS, params, use_tqdm=False)


def test_forced_tokens_are_the_output_and_logprobs_are_a_distribution(tiny_llm: Callable[..., LLM]) -> None:
    outs = forced(tiny_llm(), logprobs=-1)
    for out, want in zip(outs, FORCED):
        assert out.token_ids == want
        assert [t.token_id for t in out.logprobs] == want
        for t in out.logprobs:
            assert t.full is not None and t.full.shape == (128,)
            assert math.isclose(t.full.exp().sum().item(), 1.0, rel_tol=1e-5)
            assert t.logprob == pytest.approx(t.full[t.token_id].item())


def test_top_logprobs_are_the_largest_in_order(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm()
    full = forced(llm, logprobs=-1)
    top = forced(llm, logprobs=3)
    for f, t in zip(full, top):
        for ft, tt in zip(f.logprobs, t.logprobs):
            assert tt.full is None and len(tt.top) == 3
            values, ids = ft.full.topk(3)
            assert list(tt.top) == ids.tolist()
            assert list(tt.top.values()) == pytest.approx(values.tolist(), abs=1e-5)
            assert tt.logprob == pytest.approx(ft.logprob, abs=1e-5)


def test_logprobs_follow_the_temperature_sampled_from(tiny_llm: Callable[..., LLM]) -> None:
    # log_softmax(x / T) == log_softmax(log_softmax(x) / T): worked from the T = 1 distribution.
    llm = tiny_llm()
    base = forced(llm, logprobs=-1, temperature=1.0)
    hot = forced(llm, logprobs=-1, temperature=0.5)
    for b, h in zip(base, hot):
        for bt, ht in zip(b.logprobs, h.logprobs):
            torch.testing.assert_close(ht.full, torch.log_softmax(bt.full / 0.5, dim=-1), atol=1e-5, rtol=1e-5)


def test_sampled_tokens_carry_their_logprob_and_plain_requests_none(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm()
    asked, plain = llm.generate([PROMPTS[0], PROMPTS[0]],
                                [SamplingParams(max_tokens=6, temperature=0.8, seed=4, logprobs=2, ignore_eos=True),
                                 SamplingParams(max_tokens=6, temperature=0.8, seed=4, ignore_eos=True)],
                                use_tqdm=False)
    assert plain.logprobs is None
    assert asked.token_ids == plain.token_ids  # asking for logprobs does not change the draw
    assert [t.token_id for t in asked.logprobs] == asked.token_ids
    assert all(t.logprob <= max(t.top.values()) + 1e-6 for t in asked.logprobs)


@pytest.mark.parametrize("bad", [dict(logprobs=-2), dict(logprobs=1.5), dict(logprobs=True),
                                 dict(forced_token_ids=[1, -1]), dict(forced_token_ids=[1.0, 2]),
                                 dict(max_tokens=3, forced_token_ids=[1, 2]),
                                 dict(forced_token_ids=[1, 2], n=2, max_tokens=2),
                                 dict(logprobs=1, beam_width=2)])
def test_bad_settings_name_the_field(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="SamplingParams.(logprobs|forced_token_ids)"):
        SamplingParams(**bad)


@pytest.mark.model
def test_forced_logprobs_equal_hf_log_softmax(smol: LLM, hf_smol: Any) -> None:
    """The bundled model in fp32: each cached decode step's distribution equals HF's full forward."""
    prompt = smol.tokenizer.encode("The quick brown fox")
    continuation = smol.tokenizer.encode(" jumps over the lazy dog and runs away")
    out = smol.generate([prompt], SamplingParams(max_tokens=len(continuation), temperature=0, logprobs=-1,
                                                 forced_token_ids=continuation), use_tqdm=False)[0]
    with torch.inference_mode():
        logits = hf_smol(torch.tensor([prompt + continuation])).logits[0].float()
    ref = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    got = torch.stack([t.full for t in out.logprobs])
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


def full_recompute_logprobs(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """log-softmax after every token of `tokens`, from a forced run of the same engine: token 0
    as the prompt, the rest forced one cached step at a time (independent of prompt scoring)."""
    out = llm.generate([tokens[:1]], SamplingParams(max_tokens=len(tokens) - 1, temperature=0, logprobs=-1,
                                                    forced_token_ids=tokens[1:]), use_tqdm=False)[0]
    return torch.stack([t.full for t in out.logprobs])


@pytest.mark.parametrize("chunk", [None, 16])
def test_prompt_logprobs_score_every_prompt_token(tiny_llm: Callable[..., LLM], chunk: int | None) -> None:
    """Prefill (whole, or in chunks of 16 among other requests) scores prompt token t with the
    distribution after tokens 0..t-1, as decoding them one at a time does."""
    prompt = [(7 * j + 3) % 128 for j in range(40)]
    config = {} if chunk is None else dict(max_num_batched_tokens=chunk, max_num_seqs=4)
    llm = tiny_llm(**config)
    reference = full_recompute_logprobs(tiny_llm(), prompt)
    # A twin request warms the prefix cache first: prompt scoring must not take its blocks.
    llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    outs = llm.generate([prompt, PROMPTS[1]], [SamplingParams(max_tokens=3, prompt_logprobs=-1),
                                               SamplingParams(max_tokens=5)], use_tqdm=False)
    scored = outs[0].prompt_logprobs
    assert scored[0] is None and len(scored) == len(prompt)
    assert [t.token_id for t in scored[1:]] == prompt[1:]
    torch.testing.assert_close(torch.stack([t.full for t in scored[1:]]), reference, atol=1e-4, rtol=1e-4)
    assert outs[1].prompt_logprobs is None


def test_prompt_logprobs_survive_preemption(tiny_llm: Callable[..., LLM]) -> None:
    """A pool too small for the batch preempts and recomputes: each prompt token is scored once."""
    prompts = [[(5 * i + 11 * j) % 128 for j in range(50)] for i in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=2)
    llm = tiny_llm(kv_cache_memory=str(9 * 16 * 2 * 2 * 2 * 16 * 4), max_num_seqs=4)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    alone = tiny_llm().generate(prompts, params, use_tqdm=False)
    for out, ref in zip(outs, alone):
        assert len(out.prompt_logprobs) == len(ref.prompt_logprobs) == 50
        assert [t.logprob for t in out.prompt_logprobs[1:]] == pytest.approx(
            [t.logprob for t in ref.prompt_logprobs[1:]], abs=1e-4)


@pytest.mark.model
def test_prompt_logprobs_equal_hf_log_softmax(smol: LLM, hf_smol: Any) -> None:
    prompt = smol.tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome.")
    out = smol.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)[0]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_smol(torch.tensor([prompt])).logits[0].float(), dim=-1)
    got = [t.logprob for t in out.prompt_logprobs[1:]]
    want = ref[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1).tolist()
    assert got == pytest.approx(want, abs=1e-3)
    for t, row in zip(out.prompt_logprobs[1:], ref[:-1]):
        assert list(t.top) == row.topk(5).indices.tolist()


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_more_logprobs_than_the_vocabulary_is_refused_alone(tiny_llm: Callable[..., LLM], field: str) -> None:
    """Refused when added, naming the field; before, its top-k failed inside the step and took
    the batch down with it."""
    llm = tiny_llm()
    engine = llm.engine
    good = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=field):
        engine.add_request([4, 5], SamplingParams(max_tokens=4, **{field: TINY.vocab_size + 1}))
    engine.add_request([4, 5], SamplingParams(max_tokens=4, **{field: TINY.vocab_size}))
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert good in finished and len(finished) == 2
