"""The real server on loopback with the bundled model, through the official `openai` client and
raw HTTP. Greedy output must equal `LLM.generate` (the `smol` fixture: same model, fp32)."""
from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve import LLM, SamplingParams
from kvserve.bench.serve_load import ServerProcess

pytestmark = pytest.mark.model
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
# The served id: the bundled GGUF's name (an unknown model name gets 404, as from OpenAI).
MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def chat_prompt(llm: LLM, content: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                             add_generation_prompt=True, tokenize=False)


def test_completions_equal_offline_generate(client: openai.OpenAI, smol: LLM) -> None:
    expected = smol.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    got = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=16, temperature=0)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [o.text for o in expected]
    assert got.usage.completion_tokens == sum(len(o.token_ids) for o in expected)
    assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)


def test_chat_equals_offline_generate(client: openai.OpenAI, smol: LLM) -> None:
    question = "What is the capital of France?"
    expected = smol.generate(chat_prompt(smol, question), SamplingParams(max_tokens=20, temperature=0),
                             use_tqdm=False)[0]
    got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                         max_tokens=20, temperature=0)
    assert got.choices[0].message.content == expected.text
    assert got.choices[0].message.role == "assistant"
    assert got.usage.completion_tokens == len(expected.token_ids)


def test_streaming_completion_and_chat_match_non_streaming(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    messages = [{"role": "user", "content": "Name three colours."}]
    full_chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    deltas = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                 temperature=0, stream=True))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == full_chat.choices[0].message.content


def test_streamed_text_never_shows_a_stop_string(client: openai.OpenAI) -> None:
    """A stop string across several tokens: the stream holds back its start until it is ruled
    out, so the deltas equal the non-streaming text, which ends before it."""
    free = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0).choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 9]  # nine characters: more than one token
    full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop])
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop], stream=True) if c.choices)
    assert full.choices[0].text == free[:free.index(stop)] == streamed
    assert full.choices[0].finish_reason == "stop"


def test_n_samples_with_seed_equal_offline(client: openai.OpenAI, smol: LLM) -> None:
    params = SamplingParams(max_tokens=10, n=3, temperature=0.9, seed=7)
    expected = [o.text for o in smol.generate(PROMPTS[0], params, use_tqdm=False)]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, n=3, temperature=0.9, seed=7)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == expected


def test_models_and_health(server: ServerProcess, client: openai.OpenAI) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == MODEL


LONG = "word " * 3000
INVALID = [
    ("completions", "{not json", None),
    ("completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": [1]}, "temperature"),
    ("completions", {"max_tokens": 4}, "prompt"),
    ("completions", {"prompt": LONG, "max_tokens": 4}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": 2048}, "max_tokens"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "n": 1000}, "n"),
    ("completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "hi", "logprobs": 30}, "logprobs"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # 0 only scores, with echo
    ("completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("completions", {"prompt": "hi", "presence_penalty": 5}, "presence_penalty"),
    ("completions", '{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("completions", {"prompt": "hi", "kv_eviction": "lru"}, "kv_eviction"),
    ("completions", {"prompt": "hi", "kv_eviction": "window", "kv_budget": 3}, "kv_budget"),
    ("completions", {"prompt": "hi", "kv_eviction": "tova"}, "kv_budget"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize("endpoint, body, param", INVALID)
def test_invalid_requests_get_400_naming_the_field(server: ServerProcess, endpoint: str, body: object,
                                                   param: str | None) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.url}/v1/{endpoint}", content=content,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    # Nothing was disturbed: the next request is served.
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def scrape(server: ServerProcess) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_move_by_the_request(server: ServerProcess, smol: LLM) -> None:
    prompt = "Counting tokens is"
    n_prompt = len(smol.tokenizer.encode(prompt))
    before = scrape(server)
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 9, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("kvserve_prompt_tokens_total") == n_prompt
    assert delta("kvserve_generation_tokens_total") == 9
    assert delta("kvserve_request_finished_total", finish_reason="length") == 1
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds", "time_per_output_token_seconds"):
        assert delta(f"kvserve_{histogram}_count") == 1
    assert delta("kvserve_e2e_request_latency_seconds_sum") > 0
    assert after[("kvserve_kv_blocks_used", ())] == 0
    assert after[("kvserve_requests", (("state", "running"),))] == 0
    total = after[("kvserve_kv_blocks_used", ())] + after[("kvserve_kv_blocks_free", ())]
    assert total == server.kv_state()["num_blocks"]
    # The kernels "auto" chose: the C++ CPU backend where it builds, the reference otherwise.
    info = [dict(labels) for name, labels in after if name == "kvserve_engine_info"]
    assert len(info) == 1 and info[0]["attention_backend"] == smol.engine.attention_backend.name
    assert info[0]["chunked_prefill"] == "true"
    assert info[0]["async_scheduling"] == "false"  # auto: off on a CPU


def test_an_evicting_request_equals_offline_and_is_counted(server: ServerProcess, smol: LLM) -> None:
    prompt = ("The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz "
              "combined movable metal type, an oil-based ink and a wooden screw press. Within fifty years")
    n_prompt = len(smol.tokenizer.encode(prompt))
    freed_before = server.kv_state()["blocks_freed_by_eviction"]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, kv_eviction="window", kv_budget=12)
    want = smol.generate([prompt], params, use_tqdm=False)[0].text
    before = scrape(server)
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 20, "ignore_eos": True, "temperature": 0,
                         "kv_eviction": "window", "kv_budget": 12})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    after = scrape(server)
    key = ("kvserve_kv_evicted_tokens_total", (("policy", "window"),))
    # Down to 12 when the prompt ends; then 19 outputs run (the last is sampled, never run), and
    # a block's worth (kv_evict_interval = block_size 16) is dropped when 16 sit past the budget.
    assert after.get(key, 0) - before.get(key, 0) == n_prompt - 12 + 16
    assert after[("kvserve_kv_blocks_used", ())] == 0
    # The prompt's blocks but one at its end; then the second block decoding took, at 12 + 16.
    assert server.kv_state()["blocks_freed_by_eviction"] - freed_before == -(-n_prompt // 16) - 1 + 1


def in_use(state: dict) -> int:
    return sum(c in "US" for c in state["states"])


def wait_until_idle(server: ServerProcess, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = server.kv_state()
        if (in_use(state) == 0 and state["running"] == 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


def open_stream(server: ServerProcess, max_tokens: int = 400) -> tuple[httpx.Client, Iterator[str], object]:
    """A streaming request that has produced its first token (so it holds KV blocks)."""
    http = httpx.Client(timeout=60)
    cm = http.stream("POST", f"{server.url}/v1/completions",
                     json={"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
                           "stream": True})
    response = cm.__enter__()
    assert response.status_code == 200
    lines = response.iter_lines()
    assert next(line for line in lines if line.startswith("data:"))
    return http, lines, cm


def test_disconnect_mid_stream_frees_blocks(server: ServerProcess) -> None:
    aborted = ("kvserve_request_finished_total", (("finish_reason", "abort"),))
    before = scrape(server).get(aborted, 0.0)
    http, _, cm = open_stream(server)
    assert in_use(server.kv_state()) > 0
    cm.__exit__(None, None, None)
    http.close()
    state = wait_until_idle(server)
    assert in_use(state) == 0 and state["running"] == 0
    assert scrape(server)[aborted] == before + 1


def test_full_queue_answers_429(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server("--max-num-seqs", "1", "--max-waiting", "1", "--retry-after", "3")
    running = open_stream(srv)
    waiting = threading.Thread(target=lambda: httpx.post(
        f"{srv.url}/v1/completions", json={"prompt": "a", "max_tokens": 20, "ignore_eos": True}, timeout=120))
    waiting.start()
    while srv.kv_state()["waiting"] < 1:
        time.sleep(0.05)
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "b", "max_tokens": 5}, timeout=60)
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["type"] == "rate_limit_error"
    running[2].__exit__(None, None, None)  # free the batch slot; the waiting one goes on
    running[0].close()
    waiting.join()
    assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": "b", "max_tokens": 5},
                      timeout=60).status_code == 200
    assert in_use(wait_until_idle(srv)) == 0


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.fail("Chromium is not installed: `bash scripts/install.sh --test` installs Debian's chromium")


def headless(url: str, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp}", "--virtual-time-budget=4000", "--window-size=1280,900"]
    return subprocess.run([chromium(), *flags, *args, url], capture_output=True, text=True, timeout=120)


def test_dashboard_renders_the_block_grid(server: ServerProcess, tmp_path: Path) -> None:
    http, _, cm = open_stream(server)
    try:
        state = server.kv_state()
        dom = headless(f"{server.url}/", tmp_path / "profile-dom", "--dump-dom").stdout
        shot = tmp_path / "dashboard.png"
        headless(f"{server.url}/", tmp_path / "profile-shot", f"--screenshot={shot}")
    finally:
        cm.__exit__(None, None, None)
        http.close()
    assert 'data-ready="1"' in dom
    grid = dom.split('id="pool"', 1)[1].split('id="swap"', 1)[0]
    assert grid.count('class="block ') == state["num_blocks"]
    assert grid.count('class="block U"') + grid.count('class="block S"') >= 1
    # One group of every layer: the bundled model has no sliding window.
    assert f'id="groups">full ({len(state["kv_cache_groups"][0]["layers"])} layers): ' in dom
    assert shot.exists() and shot.stat().st_size > 5000
    wait_until_idle(server)


def test_sigterm_finishes_running_requests_then_exits(make_server) -> None:  # type: ignore[no-untyped-def]
    srv = make_server()
    http, lines, cm = open_stream(srv, max_tokens=40)
    srv.proc.terminate()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    cm.__exit__(None, None, None)
    http.close()
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert srv.proc.wait(60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{srv.url}/health", timeout=2)


def test_usage_counts_the_prompt_tokens_the_cache_served(client: openai.OpenAI, server: ServerProcess) -> None:
    """OpenAI's usage.prompt_tokens_details.cached_tokens: none on a prompt's first visit, its full
    blocks (16 tokens each; the last token is always computed) on the second, streamed too."""
    prompt = "A ledger of unusual weather, kept by a lighthouse: " + ", ".join(f"day {i} fog" for i in range(40))
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16 > 0
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
