"""OpenAI request bodies -> SamplingParams, and error parameter names."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest, param_of


def test_completion_request_maps_to_sampling_params() -> None:
    req = CompletionRequest(prompt="hi", n=2, temperature=0.5, top_p=0.9, top_k=-1, seed=3, stop="x",
                            user="ignored field")
    p = req.sampling_params(max_tokens=7)
    assert (p.max_tokens, p.n, p.temperature, p.top_p, p.top_k, p.seed, p.stop) == (7, 2, 0.5, 0.9, 0, 3, ["x"])


@pytest.mark.parametrize("prompt, expected", [
    ("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])])
def test_completion_prompt_forms(prompt: object, expected: list[object]) -> None:
    assert CompletionRequest(prompt=prompt).prompts() == expected


def test_wrong_types_are_rejected() -> None:
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="hi", max_tokens="many")
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[])


def test_unsupported_options_are_named() -> None:
    chat = [{"role": "user", "content": "a"}]
    assert ChatCompletionRequest(messages=chat, top_logprobs=2).unsupported()[0] == "top_logprobs"
    assert ChatCompletionRequest(messages=chat).unsupported() is None


def test_scoring_fields_become_sampling_params() -> None:
    chat = [{"role": "user", "content": "a"}]
    p = CompletionRequest(prompt="a", logprobs=2, echo=True, frequency_penalty=0.5, presence_penalty=-1.0,
                          logit_bias={"5": 3.0}, repetition_penalty=1.2).sampling_params(4)
    assert (p.logprobs, p.prompt_logprobs) == (2, 2)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.5, -1.0, 1.2)
    assert p.logit_bias == {5: 3.0}
    assert CompletionRequest(prompt="a", logprobs=0).sampling_params(4).prompt_logprobs is None
    assert ChatCompletionRequest(messages=chat, logprobs=True, top_logprobs=3).sampling_params(4).logprobs == 3
    assert ChatCompletionRequest(messages=chat, logprobs=True).sampling_params(4).logprobs == 0
    assert ChatCompletionRequest(messages=chat).sampling_params(4).logprobs is None
    with pytest.raises(ValueError, match="logit_bias"):
        CompletionRequest(prompt="a", logit_bias={"x": 1.0}).sampling_params(4)


def test_chat_content_parts_are_joined() -> None:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}]}])
    assert req.messages[0].text() == "ab"


@pytest.mark.parametrize("message, param", [
    ("SamplingParams.top_p must be in (0, 1], got 2", "top_p"),
    ("max_tokens: 5 prompt tokens + max_tokens 9 exceed", "max_tokens"),
    ("prompt: 900 tokens exceed the device KV pool", "prompt")])
def test_param_of_engine_errors(message: str, param: str) -> None:
    assert param_of(message) == param
