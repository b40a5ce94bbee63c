"""Incremental detokenization on the bundled tokenizer: the deltas add up to a whole decode, and a
character split across byte-level tokens appears only once it is whole."""
from __future__ import annotations

import random
from typing import Any

import pytest

from kvserve.engine.detokenizer import Detokenizer
from kvserve.model.loader import convert_gguf, default_model_path, load_tokenizer

pytestmark = pytest.mark.model

TEXTS = ["The capital of France is Paris.", "naïve café 東京 🙂 ok", "  def f(x):\n\treturn x ** 2  ",
         "<|im_start|>user\nhi<|im_end|> after"]


class DecodeOnly:
    """The same tokenizer without its Rust backend: the windowed path."""

    def __init__(self, tokenizer: Any) -> None:
        self.decode = tokenizer.decode


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(convert_gguf(default_model_path()))


def deltas(detokenizer: Detokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.step(ids[:i + 1]) for i in range(len(ids))]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "window"])
def test_deltas_add_up_to_the_decoded_text(tokenizer: Any, stream: bool) -> None:
    rng = random.Random(0)
    cases = [tokenizer.encode(t) for t in TEXTS]
    cases += [[rng.randrange(tokenizer.vocab_size) for _ in range(40)] for _ in range(5)]  # any ids
    for ids in cases:
        got = deltas(Detokenizer(tokenizer if stream else DecodeOnly(tokenizer)), ids)
        assert "".join(got) == tokenizer.decode(ids, skip_special_tokens=True)
        assert all("\ufffd" not in d for d in got) or "\ufffd" in tokenizer.decode(ids)


def test_a_split_character_waits_for_its_last_byte(tokenizer: Any) -> None:
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1  # byte-level pieces
    assert deltas(Detokenizer(tokenizer), ids) == [""] * (len(ids) - 1) + ["🙂"]


def test_a_late_start_catches_up_in_one_step(tokenizer: Any) -> None:
    """A forked sample starts a detokenizer of its own over the outputs it shares."""
    ids = tokenizer.encode(TEXTS[1])
    for stream in (tokenizer, DecodeOnly(tokenizer)):
        late = Detokenizer(stream)
        first = late.step(ids[:6])
        assert first == tokenizer.decode(ids[:6]).rstrip("\ufffd")
        assert first + "".join(late.step(ids[:i + 1]) for i in range(6, len(ids))) == tokenizer.decode(ids)
