"""What the server refuses and what it takes (issue 39's hostile round): each case was answered
otherwise before, as its comment says."""
from __future__ import annotations

import math
import subprocess
import sys
import time
from typing import Any

import httpx
import openai
import pytest

from kvserve.bench.serve_load import ServerProcess
from kvserve.net import free_loopback_port
from kvserve.sampling_params import MAX_STOP_CHARS, MAX_STOPS

CHAT = [{"role": "user", "content": "hi"}]


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def assert_refused(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"], r.text


@pytest.mark.parametrize("stop", [
    ["x"] * (MAX_STOPS + 1), ["x" * (MAX_STOP_CHARS + 1)],
    ["no such text " * 8] * 26_000,  # the tester's ~2.6 MB, which slowed every other client 4x
])
def test_stop_strings_past_the_caps_are_refused_naming_stop(server: ServerProcess, stop: list[str]) -> None:
    assert_refused(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": stop}), "stop")
    fine = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": ["x" * MAX_STOP_CHARS] * MAX_STOPS})
    assert fine.status_code == 200, fine.text


@pytest.mark.parametrize("path, fields, param", [
    # Each was a 200 and an ordinary sample: a typo, and options the engine has no request field for.
    ("/v1/completions", {"temprature": 0}, "temprature"),
    ("/v1/completions", {"beam_width": 4}, "beam_width"),
    ("/v1/completions", {"forced_token_ids": [1, 2]}, "forced_token_ids"),
    ("/v1/completions", {"min-tokens": 3}, "min-tokens"),  # named whole, though not an identifier
    ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, "messages.0.name"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": True, "extra": 1}},
     "stream_options.extra"),
])
def test_unknown_fields_are_refused_naming_them(server: ServerProcess, path: str, fields: dict[str, Any],
                                                param: str) -> None:
    base: dict[str, Any] = {"prompt": "hi"} if path == "/v1/completions" else {"messages": CHAT}
    assert_refused(post(server, path, {**base, "max_tokens": 2, **fields}), param)


def test_openai_fields_that_change_no_output_are_taken(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt="hi", max_tokens=2, user="u-1")
    assert done.usage is not None and done.usage.completion_tokens == 2
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=2,  # type: ignore[arg-type]
                                          user="u-1", safety_identifier="s-1", metadata={"run": "a"},
                                          store=False, parallel_tool_calls=False)
    assert chat.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match="store"):  # nothing is stored here
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=2, store=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", [" 1", "\u0663", "+1", "1_0", "-1"])
def test_logit_bias_keys_are_ascii_token_ids(server: ServerProcess, key: str) -> None:
    # int() reads all of these: " 1" and "+1" as token 1, "\u0663" (Arabic-Indic three) as 3.
    assert_refused(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {key: 5}}),
                   "logit_bias")
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {"1": 5}}).status_code == 200


def test_temperature_is_held_to_openais_range(server: ServerProcess) -> None:
    for temperature in (1e308, 2.5):  # 1e308 was taken: fp32 made it inf
        assert_refused(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                        "temperature": temperature}), "temperature")
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": 2, "logprobs": 2, "seed": 1})
    assert r.status_code == 200, r.text
    logprobs = r.json()["choices"][0]["logprobs"]
    values = logprobs["token_logprobs"] + [v for top in logprobs["top_logprobs"] for v in top.values()]
    assert len(logprobs["token_logprobs"]) == 4 and all(math.isfinite(v) and v <= 0 for v in values)


def test_naming_no_replica_of_a_one_engine_server_is_refused(server: ServerProcess) -> None:
    r = httpx.get(f"{server.url}/kv/state", params={"replica": "zzz"}, timeout=30)  # was the engine's state
    assert_refused(r, "replica")
    assert httpx.get(f"{server.url}/kv/state", timeout=30).json()["num_blocks"] > 0


def test_an_empty_api_key_is_a_usage_error_before_the_model_loads() -> None:
    # It was refused by ServerSettings once the model had loaded, with a traceback.
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "kvserve", "serve", "--api-key=", "--port", str(free_loopback_port())],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "argument --api-key: must not be empty" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and time.monotonic() - start < 60
