"""OpenAI request bodies -> SamplingParams, and error parameter names."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvserve.sampling_params import SamplingParams
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest, field_of


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
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert req.messages[0].text() == "ab" and req.unsupported() is None


@pytest.mark.parametrize("field, value", [
    ("n", True), ("n", "2"), ("max_tokens", True), ("max_tokens", "5"), ("seed", "3"), ("top_k", False),
    ("logprobs", True), ("kv_budget", "64"), ("prompt", [True, 2]), ("temperature", "0.5"), ("top_p", True),
    ("stream", "true"), ("echo", 1)])
def test_completion_fields_are_strictly_typed(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as err:
        CompletionRequest.model_validate({"prompt": "hi", field: value})
    assert err.value.errors()[0]["loc"][0] == field
    assert CompletionRequest(prompt="hi", temperature=1).temperature == 1.0  # an integer is a number


@pytest.mark.parametrize("field, value", [
    ("max_tokens", True), ("max_completion_tokens", "5"), ("top_logprobs", True), ("logprobs", 1), ("n", 2.5)])
def test_chat_fields_are_strictly_typed(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "a"}], field: value})
    assert err.value.errors()[0]["loc"][0] == field


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": None}]}, "messages.1.content"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.1.tool_calls"),
    ({"modalities": ["text", "audio"]}, "modalities"), ({"audio": {"voice": "alloy"}}, "audio"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"), ({"min_tokens": 5}, "min_tokens"),
])
def test_unsupported_chat_features_are_named(fields: dict, param: str) -> None:  # type: ignore[type-arg]
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "a"}], **fields})
    assert req.unsupported()[0] == param  # type: ignore[index]


@pytest.mark.parametrize("fields", [
    {"tools": []}, {"tool_choice": "none"}, {"response_format": {"type": "text"}},
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}]},
    {"modalities": ["text"]}, {"min_tokens": 0}, {"messages": [{"role": "assistant", "content": "a", "tool_calls": []}]}])
def test_chat_options_that_ask_for_nothing_are_accepted(fields: dict) -> None:  # type: ignore[type-arg]
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "a"}], **fields})
    assert req.unsupported() is None


@pytest.mark.parametrize("fields, param", [
    ({"top_p": 2.0}, "top_p"), ({"max_tokens": 0}, "max_tokens"), ({"kv_budget": 0}, "kv_budget"),
    ({"stop": [""]}, "stop"), ({"n": 2, "beam_width": 2}, "n")])
def test_sampling_errors_carry_their_field(fields: dict, param: str) -> None:  # type: ignore[type-arg]
    """The server's `param` comes from the error's field, not from its wording."""
    with pytest.raises(ValueError) as caught:
        SamplingParams(**fields)
    assert field_of(caught.value) == param


def test_errors_without_a_field_name_none() -> None:
    assert field_of(ValueError("top_p: looks like a field but is not one")) is None


@pytest.mark.parametrize("fields, param", [({"best_of": 3}, "best_of"), ({"best_of": 3, "n": 2}, "best_of"),
                                           ({"suffix": "end"}, "suffix"), ({"min_tokens": 1}, "min_tokens")])
def test_unsupported_completion_options_are_named(fields: dict, param: str) -> None:  # type: ignore[type-arg]
    # They were taken and ignored: best_of 3 returned one sample drawn at random, not the best.
    assert CompletionRequest.model_validate({"prompt": "a", **fields}).unsupported()[0] == param  # type: ignore[index]
    for fine in ({"best_of": 1}, {"best_of": 2, "n": 2}, {"suffix": ""}, {}):
        assert CompletionRequest.model_validate({"prompt": "a", **fine}).unsupported() is None


def test_a_stop_string_with_a_lone_surrogate_is_refused() -> None:
    with pytest.raises(ValueError, match="^SamplingParams.stop: not valid Unicode"):
        CompletionRequest.model_validate({"prompt": "a", "stop": "x\ud800"}).sampling_params(4)


def test_nulls_mean_the_default_and_whole_floats_are_integers() -> None:
    # Strict typing refused both, though OpenAI's spec marks these fields nullable and clients
    # that compute a limit in floats send 256.0 (vLLM takes both).
    nulls = {name: None for name in ("temperature", "top_p", "n", "stream", "echo", "presence_penalty",
                                     "max_tokens", "min_tokens", "seed", "stop", "logprobs")}
    req = CompletionRequest.model_validate({"prompt": "hi", **nulls})
    assert (req.temperature, req.top_p, req.n, req.stream, req.max_tokens, req.seed) == (1.0, 1.0, 1, False, 16, None)
    req = CompletionRequest.model_validate({"prompt": "hi", "n": 2.0, "max_tokens": 256.0})
    assert (req.n, req.max_tokens) == (2, 256) and type(req.max_tokens) is int
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "a"}], "logprobs": None,
                                                 "max_completion_tokens": 3.0})
    assert chat.logprobs is False and chat.max_completion_tokens == 3
