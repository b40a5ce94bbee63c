"""The faults a hostile tester found in the server (issue 10, part 4), each as a test."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from kvserve.bench.serve_load import ServerProcess
from kvserve.server.settings import ServerSettings


def in_use(state: dict) -> int:  # type: ignore[type-arg]
    return sum(c in "US" for c in state["states"])


def wait_idle(server: ServerProcess, timeout: float = 30) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = server.kv_state()
        if state["running"] == 0 and state["waiting"] == 0 and in_use(state) == 0:
            return state
        time.sleep(0.1)
    raise AssertionError(f"not idle after {timeout} s: {state}")


def post(server: ServerProcess, path: str, body: object, **kw: object) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json",
                                                                       **kw.pop("headers", {})},  # type: ignore[dict-item]
                      timeout=60, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": [], "max_tokens": 2}, 400, "prompt"),                    # was 200 with no choices
    ({"prompt": "hi", "model": "gpt-4o"}, 404, "model"),                  # was accepted silently
    ({"prompt": 5, "max_tokens": 2}, 400, "prompt"),                      # was param "prompt.str"
    ('{"prompt": ' + "[" * 5000 + "]" * 5000 + "}", 400, None),           # was FastAPI's {"detail": ...}
])
def test_bad_completions_get_openai_errors(server: ServerProcess, body: object, status: int,
                                           param: str | None) -> None:
    r = post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    if status == 404:
        assert error["code"] == "model_not_found"


def test_a_json_body_without_its_content_type_is_told_so(server: ServerProcess) -> None:
    # curl -d sends application/x-www-form-urlencoded: the error was "body: Input should be a
    # valid dictionary or object to extract fields from".
    r = httpx.post(f"{server.url}/v1/completions", content=json.dumps({"prompt": "hi", "max_tokens": 1}),
                   headers={"content-type": "application/x-www-form-urlencoded"}, timeout=60)
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"], r.text


def test_max_completion_tokens_is_named_as_sent(server: ServerProcess) -> None:
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                              "max_completion_tokens": -3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"


def test_more_prompts_than_the_queue_holds_is_400_not_429(make_server: Callable[..., ServerProcess]) -> None:
    srv = make_server("--max-waiting", "8", "--max-num-seqs", "4")
    # 4 run, 8 wait: 12 at most, or 6 with 2 samples each (a seat per sample).
    for prompts, n, status in ((13, 1, 400), (12, 1, 200), (11, 2, 400), (10, 2, 200)):
        r = post(srv, "/v1/completions", {"prompt": ["a"] * prompts, "n": n, "max_tokens": 1})
        assert r.status_code == status, r.text
        if status == 400:
            assert r.json()["error"]["param"] == "prompt" and "retry-after" not in r.headers


def test_a_burst_that_fits_the_batch_gets_no_429(make_server: Callable[..., ServerProcess]) -> None:
    # --max-waiting bounds the requests waiting for a batch seat; those that the next step admits
    # do not wait. It counted every request the engine had not yet stepped, so on an idle server
    # with 16 seats most of a burst of 16 got 429.
    srv = make_server("--max-waiting", "2", "--max-num-seqs", "16")

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as http:
            replies = await asyncio.gather(*(http.post(f"{srv.url}/v1/completions",
                                                       json={"prompt": f"Request {i}:", "max_tokens": 4})
                                             for i in range(16)))
        return [r.status_code for r in replies]

    assert asyncio.run(burst()) == [200] * 16


def test_a_non_streaming_client_that_hangs_up_is_aborted(server: ServerProcess) -> None:
    body = json.dumps({"prompt": "Tell me a long story.", "max_tokens": 1500, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 30
        while server.kv_state()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.kv_state()["running"] == 1
    # 1500 tokens would take minutes; the hang-up ends it within a poll or two.
    state = wait_idle(server, timeout=20)
    assert state["running"] == 0


def test_huge_prompts_get_413_and_health_stays_responsive(server: ServerProcess) -> None:
    big = json.dumps({"prompt": "word " * 1_000_000, "max_tokens": 1})  # 5 MB
    stalls: list[float] = []

    def probe() -> None:
        for _ in range(20):
            start = time.monotonic()
            httpx.get(f"{server.url}/health", timeout=30)
            stalls.append(time.monotonic() - start)
            time.sleep(0.05)

    t = threading.Thread(target=probe)
    t.start()
    r = post(server, "/v1/completions", big)
    t.join()
    assert r.status_code == 413 and "max-request-bytes" in r.json()["error"]["message"]
    assert max(stalls) < 2.0


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "word " * 600_000, "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": ["hi", "word " * 600_000], "max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 600_000}]}, "messages"),
])
def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(
        server: ServerProcess, path: str, body: dict, param: str) -> None:  # type: ignore[type-arg]
    # 3 MB of text fit the request limit; tokenizing them took ~3 s of the engine's cores before
    # the engine found 600,000 tokens past max_model_len 2048.
    r = post(server, path, body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and "max_model_len=2048" in error["message"], r.text
    assert "3000000 bytes of text are at least" in error["message"]  # judged on bytes, not tokens


def test_a_chunked_body_is_held_to_the_size_limit(server: ServerProcess) -> None:
    def chunked(text: str) -> Iterator[bytes]:  # no Content-Length: httpx sends it chunked
        data = text.encode()
        for start in range(0, len(data), 2**16):
            yield data[start:start + 2**16]

    def send(text: str) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/completions", content=chunked(text),
                          headers={"content-type": "application/json"}, timeout=60)

    big = send(json.dumps({"prompt": "word " * 1_000_000, "max_tokens": 1}))  # 5 MB, limit 4 MiB
    assert big.status_code == 413 and "max-request-bytes" in big.json()["error"]["message"]
    small = send(json.dumps({"prompt": "Hello" + " " * 100_000, "max_tokens": 1}))
    assert small.status_code == 200 and len(small.json()["choices"]) == 1


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "\udfff"], "max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 1},
     "messages.0.content"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "cache_salt": "\ud800"}, "cache_salt"),
])
def test_lone_surrogates_are_400_naming_the_field(server: ServerProcess, path: str, body: dict,  # type: ignore[type-arg]
                                                  param: str) -> None:
    r = post(server, path, body)  # json.dumps writes the surrogate as JSON allows it
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    field = param.split(".")[0]
    fine = [{"role": "user", "content": "fine"}] if field == "messages" else "fine"
    assert post(server, path, {**body, field: fine}).status_code == 200
    assert wait_idle(server)["running"] == 0


def test_dns_rebinding_hosts_are_refused(server: ServerProcess) -> None:
    r = httpx.get(f"{server.url}/v1/models", headers={"host": "evil.example:8000"}, timeout=30)
    assert r.status_code == 400 and "Host" in r.json()["error"]["message"]
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", f"[::1]:{server.port}"):
        assert httpx.get(f"{server.url}/v1/models", headers={"host": host}, timeout=30).status_code == 200


def test_host_rules() -> None:
    assert ServerSettings.hosts_for("0.0.0.0", None) == ("*",)
    assert ServerSettings.hosts_for("10.1.2.3", None) == ("10.1.2.3",)
    assert ServerSettings.hosts_for("127.0.0.1", "a.example, b.example") == ("a.example", "b.example")
    s = ServerSettings(allowed_hosts=("api.example",))
    assert s.host_allowed("api.example:443") and s.host_allowed("API.example")
    assert not s.host_allowed("api.example.evil.com") and not s.host_allowed(None)
    with pytest.raises(ValueError, match="ServerSettings.api_key"):
        ServerSettings(api_key="")


def test_request_ids_stay_private_and_the_api_key_guards_everything(
        make_server: Callable[..., ServerProcess]) -> None:
    srv = make_server("--api-key", "s3cret")
    auth = {"authorization": "Bearer s3cret"}
    assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 200
    for path in ("/v1/models", "/metrics", "/kv/state"):
        r = httpx.get(f"{srv.url}{path}", timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{srv.url}{path}", headers={"authorization": "Bearer wrong"}, timeout=30).status_code == 401
        assert httpx.get(f"{srv.url}{path}", headers=auth, timeout=30).status_code == 200
    # The scheme's name is case-insensitive (RFC 9110): "bearer" was a 401 (issue 39).
    for given, status in (("bearer s3cret", 200), ("BEARER  s3cret", 200), ("Basic s3cret", 401),
                          ("Bearers3cret", 401), ("bearer s3cre", 401), ("s3cret", 401)):
        assert httpx.get(f"{srv.url}/v1/models", headers={"authorization": given}, timeout=30).status_code == status
    assert post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 1}).status_code == 401
    # A request in flight shows in the pool map as a number, not by its id.
    done = threading.Event()
    threading.Thread(target=lambda: (post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 64,
                                                                   "ignore_eos": True}, headers=auth),
                                     done.set())).start()
    deadline = time.monotonic() + 30
    while not done.is_set() and time.monotonic() < deadline:
        state = httpx.get(f"{srv.url}/kv/state", headers=auth, timeout=30).json()
        if state["sequences"]:
            assert all(s.startswith("sequence ") for s in state["sequences"])
            assert not any("cmpl" in s for s in state["sequences"])
            break
        time.sleep(0.05)
    else:
        raise AssertionError("never saw the request in /kv/state")
    done.wait(120)


def test_sigterm_past_the_timeout_ends_streams_cleanly_and_answers_503_meanwhile(
        make_server: Callable[..., ServerProcess]) -> None:
    srv = make_server("--shutdown-timeout", "3")
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{srv.url}/v1/completions",
                         json={"prompt": "Once", "max_tokens": 1500, "ignore_eos": True, "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            srv.proc.terminate()
            time.sleep(0.5)
            # Draining: still listening, but no new work; /health tells load balancers to go.
            refused = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            assert refused.status_code == 503
            assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 503
            rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][6:])
    assert "shut down" in error["error"]["message"]
    assert srv.proc.wait(60) == 0


def test_a_non_streaming_request_cut_by_shutdown_gets_503(make_server: Callable[..., ServerProcess]) -> None:
    srv = make_server("--shutdown-timeout", "2")
    result: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: result.update(r=post(srv, "/v1/completions", {
        "prompt": "Once", "max_tokens": 1500, "ignore_eos": True})))
    t.start()
    deadline = time.monotonic() + 30
    while srv.kv_state()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    srv.proc.terminate()
    t.join(60)
    r = result["r"]
    assert r.status_code == 503 and "shut down" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "service_unavailable"
    assert srv.proc.wait(60) == 0


# Issue 10, part 5: the second hostile round.

def test_chat_logprob_bytes_are_each_tokens_own(server: ServerProcess) -> None:
    # The model answers with crabs, each 🦀 three byte-level tokens whose text alone is U+FFFD.
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Repeat exactly: 🦀"}],
                                              "max_tokens": 6, "temperature": 0, "logprobs": True,
                                              "top_logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text, content = choice["message"]["content"], choice["logprobs"]["content"]
    assert "🦀" in text and any(entry["token"].startswith("bytes:") for entry in content)  # pieces named by bytes
    assert b"".join(bytes(entry["bytes"]) for entry in content) == text.encode()
    for entry in content:  # greedy: the first alternative is the token itself
        assert entry["top_logprobs"][0]["bytes"] == entry["bytes"]


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}]},
     "messages.0.content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
])
def test_unsupported_chat_features_are_400_naming_the_field(server: ServerProcess, fields: dict,  # type: ignore[type-arg]
                                                            param: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "max_tokens", True),
    ("/v1/completions", "max_tokens", "5"),
    ("/v1/completions", "n", "2"),
    ("/v1/completions", "logprobs", True),
    ("/v1/completions", "seed", "7"),
    ("/v1/completions", "top_k", True),
    ("/v1/chat/completions", "max_completion_tokens", "5"),
    ("/v1/chat/completions", "top_logprobs", True),
    ("/v1/chat/completions", "max_tokens", True),
])
def test_integer_fields_refuse_bools_and_strings(server: ServerProcess, path: str, field: str,
                                                 value: object) -> None:
    base: dict[str, object] = ({"prompt": "hi"} if path == "/v1/completions"
                               else {"messages": [{"role": "user", "content": "hi"}], "logprobs": True})
    r = post(server, path, {**base, "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert post(server, path, {**base, "max_tokens": 2, field: 2}).status_code == 200


def test_streamed_text_offsets_equal_the_whole_reply(server: ServerProcess) -> None:
    for body in ({"prompt": "Count: one, two,", "max_tokens": 8, "logprobs": 1, "temperature": 0},
                 {"prompt": "Count: one, two,", "max_tokens": 8, "logprobs": 1, "temperature": 0, "echo": True}):
        whole = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
        offsets: list[int] = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and (lp := json.loads(line[6:])["choices"][0]["logprobs"]):
                    offsets += lp["text_offset"]
        assert offsets == whole["text_offset"] and offsets[-1] > 0
