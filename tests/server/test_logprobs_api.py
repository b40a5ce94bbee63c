"""Scoring through the OpenAI client: echo + logprobs (lm-eval's way) and chat top_logprobs,
against HF transformers' fp32 log-softmax on the bundled model."""
from __future__ import annotations

from typing import Any

import openai
import pytest
import torch

from kvserve import LLM
from kvserve.bench.serve_load import ServerProcess


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def hf_logprobs(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_with_max_tokens_0_scores_the_prompt_like_hf(client: openai.OpenAI, model: str, smol: LLM,
                                                         hf_smol: Any) -> None:
    text = "The capital of France is Paris. The capital of Italy is Rome."
    ids = smol.tokenizer.encode(text)
    out = client.completions.create(model=model, prompt=text, max_tokens=0, echo=True, logprobs=3,
                                    temperature=0)
    choice = out.choices[0]
    assert choice.text == text and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == text and lp.text_offset[0] == 0
    ref = hf_logprobs(hf_smol, ids)
    want = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-3)
    for top, row in zip(lp.top_logprobs[1:], ref[:-1]):
        values = row.topk(3).values.tolist()
        assert sorted(top.values(), reverse=True) == pytest.approx(values, abs=1e-3)


def test_completion_logprobs_of_generated_tokens(client: openai.OpenAI, model: str, smol: LLM,
                                                 hf_smol: Any) -> None:
    prompt = "Once upon a time"
    out = client.completions.create(model=model, prompt=prompt, max_tokens=6, logprobs=2, temperature=0)
    ids = smol.tokenizer.encode(prompt)
    lp = out.choices[0].logprobs
    generated = smol.tokenizer.encode(out.choices[0].text)
    assert len(lp.token_logprobs) == 6 and "".join(lp.tokens) == out.choices[0].text
    ref = hf_logprobs(hf_smol, ids + generated[:5])
    assert lp.token_logprobs == pytest.approx(
        ref[len(ids) - 1:].gather(1, torch.tensor(generated[:6])[:, None]).squeeze(1).tolist(), abs=1e-3)


def test_chat_top_logprobs_equal_hf(client: openai.OpenAI, model: str, smol: LLM, hf_smol: Any) -> None:
    messages = [{"role": "user", "content": "Name a color."}]
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=4)
    content = out.choices[0].logprobs.content
    assert len(content) == 5 and "".join(c.token for c in content) == out.choices[0].message.content
    prompt = smol.tokenizer.encode(smol.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                      tokenize=False))
    tokens = [smol.tokenizer.encode(c.token) for c in content]
    assert all(len(t) == 1 for t in tokens)  # each entry is one token
    flat = [t[0] for t in tokens]
    ref = hf_logprobs(hf_smol, prompt + flat[:-1])[len(prompt) - 1:]
    for entry, token, row in zip(content, flat, ref):
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-3)
        assert entry.token == entry.top_logprobs[0].token  # greedy: the top alternative
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(row.topk(4).values.tolist(), abs=1e-3)
        assert bytes(entry.bytes).decode() == entry.token


def test_streamed_logprobs_equal_the_whole_reply(client: openai.OpenAI, model: str) -> None:
    args: dict[str, Any] = dict(model=model, prompt="Count: one, two,", max_tokens=8, logprobs=1, temperature=0)
    whole = client.completions.create(**args).choices[0].logprobs
    tokens, logprobs = [], []
    for chunk in client.completions.create(stream=True, **args):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            logprobs += chunk.choices[0].logprobs.token_logprobs
    assert tokens == whole.tokens and logprobs == pytest.approx(whole.token_logprobs)


def test_streamed_echo_scoring_sends_the_whole_prompt_and_no_completion(client: openai.OpenAI, model: str) -> None:
    text = "The capital of France is Paris."
    args: dict[str, Any] = dict(model=model, prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=0)
    whole = client.completions.create(**args).choices[0]
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **args) if c.choices)
    assert whole.text == streamed == text
