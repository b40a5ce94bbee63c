"""Rendering engine outputs as OpenAI's text: token bytes (on the real tokenizer)."""
from __future__ import annotations

import pytest

from kvserve import LLM
from kvserve.server.rendering import longest_token_bytes, token_bytes_of

pytestmark = pytest.mark.model


def test_token_bytes_read_the_byte_level_alphabet(smol: LLM) -> None:
    tokenizer = smol.tokenizer
    token_bytes = token_bytes_of(tokenizer, lambda token: tokenizer.decode([token]))
    texts = tokenizer.batch_decode([[token] for token in range(len(tokenizer))])
    # Every token that is whole characters (special tokens included) has its text's bytes...
    assert all(token_bytes(token) == text.encode() for token, text in enumerate(texts) if "\ufffd" not in text)
    # ...and the pieces of characters add up to them.
    ids = tokenizer.encode("日本語 🦀 naïve")
    assert b"".join(map(token_bytes, ids)) == "日本語 🦀 naïve".encode()


def test_no_token_covers_more_bytes_than_the_bound(smol: LLM) -> None:
    tokenizer = smol.tokenizer
    token_bytes = token_bytes_of(tokenizer, lambda token: tokenizer.decode([token]))
    longest = longest_token_bytes(tokenizer)
    # The bound read from the pieces equals the longest token's bytes read through the alphabet.
    assert longest == max(len(token_bytes(token)) for token in range(len(tokenizer)))
    # So a text of B bytes is never fewer than B / longest tokens, even the one built of it.
    text = tokenizer.decode([max(range(len(tokenizer)), key=lambda t: len(token_bytes(t)))] * 50)
    assert len(tokenizer.encode(text)) >= len(text.encode()) / longest
