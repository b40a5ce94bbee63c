"""Scoring through the OpenAI client: echo + logprobs (lm-eval's way) and chat top_logprobs,
against HF transformers' fp32 log-softmax on the bundled model."""
from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import torch

from kvserve import LLM, SamplingParams
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
    for token, top, row in zip(ids[1:], lp.top_logprobs[1:], ref[:-1]):
        best = row.topk(3)
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(best.values.tolist(), abs=1e-3)
        assert len(top) == 3 + (token not in best.indices.tolist())  # the prompt's token, where not in the top


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


def completion(server: ServerProcess, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The first choice's text and logprobs, asked whole and streamed (each must equal the other)."""
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    whole = r.json()["choices"][0]
    text, lps = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {") and (choices := json.loads(line[6:])["choices"]):
                text += choices[0]["text"]
                for key, values in (choices[0]["logprobs"] or {}).items():
                    lps[key] += values
    assert text == whole["text"]
    if whole["logprobs"] is not None:
        assert lps == whole["logprobs"]
    return whole["text"], whole["logprobs"]


EMOJI = "🎉 café 日本"  # byte-level BPE splits the emoji and 日 over several tokens each
JAPANESE = "日本語のテキストです。東京は首都です。"


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_decodes_the_prompt_whole(server: ServerProcess, smol: LLM, max_tokens: int) -> None:
    ids = smol.tokenizer.encode(EMOJI)
    assert smol.tokenizer.decode(ids) == EMOJI and any(smol.tokenizer.decode([t]) == "\ufffd" for t in ids)
    for prompt in (EMOJI, ids):
        base = {"prompt": prompt, "max_tokens": max_tokens, "echo": True, "temperature": 0}
        for body in (base, {**base, "logprobs": 1}):
            text, _ = completion(server, body)
            assert text.startswith(EMOJI) and (max_tokens or text == EMOJI), (prompt, body, text)


def check_offsets(text: str, lp: dict[str, Any]) -> None:
    """Each token starts where its text is in `text`; a token holding part of a character (its
    text alone is U+FFFD, and it is named by its bytes) lies between its neighbours."""
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(text), (offsets, len(text))
    for token, offset in zip(lp["tokens"], offsets):
        if not token.startswith("bytes:"):
            assert text[offset:offset + len(token)] == token, (token, offset, text)


# The second: special tokens, which an output's text leaves out, are in an echoed prompt's.
@pytest.mark.parametrize("prompt", [JAPANESE, "<|im_start|>user\n日本 hi<|im_end|>"])
def test_text_offsets_count_characters_not_token_pieces(server: ServerProcess, smol: LLM, prompt: str) -> None:
    ids = smol.tokenizer.encode(prompt)
    text, lp = completion(server, {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert text == prompt and len(lp["text_offset"]) == len(ids)
    # A token starts where the whole characters of the tokens before it end (the quadratic way).
    assert lp["text_offset"] == [len(smol.tokenizer.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    check_offsets(text, lp)


@pytest.mark.parametrize("echo", [False, True])
def test_text_offsets_of_generated_multibyte_text(server: ServerProcess, smol: LLM, echo: bool) -> None:
    prompt = JAPANESE * 2  # the model goes on in Japanese, with tokens that split characters
    ids = smol.generate(prompt, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0].token_ids
    text, lp = completion(server, {"prompt": prompt, "max_tokens": 24, "logprobs": 1, "temperature": 0,
                                   "echo": echo})
    assert any(smol.tokenizer.decode([t]) == "\ufffd" for t in ids)
    start = len(prompt) if echo else 0
    assert text[start:] == smol.tokenizer.decode(ids, skip_special_tokens=True)
    assert lp["text_offset"][-len(ids):] == [
        start + len(smol.tokenizer.decode(ids[:i], skip_special_tokens=True).rstrip("\ufffd")) for i in range(len(ids))]
    check_offsets(text, lp)


def test_top_logprobs_hold_the_chosen_token(server: ServerProcess) -> None:
    # Echoed prompt tokens and tokens sampled hot are often not the model's most likely.
    for body in ({"prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 0, "echo": True},
                 {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 1.5, "seed": 3}):
        _, lp = completion(server, {**body, "logprobs": 1})
        positions = [(t, v, top) for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])
                     if top is not None]
        for token, logprob, top in positions:
            assert top[token] == pytest.approx(logprob) and 1 <= len(top) <= 2, (token, logprob, top)
        assert any(len(top) == 2 for _, _, top in positions)


def label_bytes(label: str) -> bytes:
    """What a logprobs token name stands for: its text, or the bytes a "bytes:" name escapes."""
    return bytes.fromhex(label[6:].replace("\\x", "")) if label.startswith("bytes:") else label.encode()


def test_pieces_of_characters_are_named_by_their_bytes(server: ServerProcess, smol: LLM) -> None:
    # Byte-level pieces of characters all decode to U+FFFD: as keys of top_logprobs they collided
    # (20 asked, fewer given), and the tokens list lost their bytes.
    text, lp = completion(server, {"prompt": JAPANESE, "max_tokens": 0, "echo": True, "logprobs": 20})
    assert any(t.startswith("bytes:") for t in lp["tokens"])
    assert b"".join(map(label_bytes, lp["tokens"])) == JAPANESE.encode() == text.encode()
    tops = [top for top in lp["top_logprobs"] if top is not None]
    assert all(len(top) >= 20 for top in tops), [len(top) for top in tops]
    assert any(k.startswith("bytes:") for top in tops for k in top)
    # The chat form names the same pieces the same way, beside their bytes.
    r = httpx.post(f"{server.url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Reply in Japanese: " + JAPANESE}], "max_tokens": 16,
        "temperature": 0, "logprobs": True, "top_logprobs": 5}, timeout=60)
    content = r.json()["choices"][0]["logprobs"]["content"]
    for item in [*content, *(t for c in content for t in c["top_logprobs"])]:
        assert label_bytes(item["token"]) == bytes(item["bytes"]), item
