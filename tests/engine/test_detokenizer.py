"""Incremental detokenization on the bundled tokenizer: the deltas add up to a whole decode, and a
character split across byte-level tokens appears only once it is whole."""
from __future__ import annotations

import random
from typing import Any

import pytest

from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from kvserve.engine.detokenizer import Detokenizer
from kvserve.model.gguf_convert import convert_gguf
from kvserve.model.loader import default_model_path, load_tokenizer

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


@pytest.mark.model
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "window"])
def test_deltas_add_up_to_the_decoded_text(tokenizer: Any, stream: bool) -> None:
    rng = random.Random(0)
    cases = [tokenizer.encode(t) for t in TEXTS]
    cases += [[rng.randrange(tokenizer.vocab_size) for _ in range(40)] for _ in range(5)]  # any ids
    for ids in cases:
        got = deltas(Detokenizer(tokenizer if stream else DecodeOnly(tokenizer)), ids)
        assert "".join(got) == tokenizer.decode(ids, skip_special_tokens=True)
        assert all("\ufffd" not in d for d in got) or "\ufffd" in tokenizer.decode(ids)


@pytest.mark.model
def test_a_split_character_waits_for_its_last_byte(tokenizer: Any) -> None:
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1  # byte-level pieces
    assert deltas(Detokenizer(tokenizer), ids) == [""] * (len(ids) - 1) + ["🙂"]


@pytest.mark.model
def test_a_late_start_catches_up_in_one_step(tokenizer: Any) -> None:
    """A forked sample starts a detokenizer of its own over the outputs it shares."""
    ids = tokenizer.encode(TEXTS[1])
    for stream in (tokenizer, DecodeOnly(tokenizer)):
        late = Detokenizer(stream)
        first = late.step(ids[:6])
        assert first == tokenizer.decode(ids[:6]).rstrip("\ufffd")
        assert first + "".join(late.step(ids[:i + 1]) for i in range(6, len(ids))) == tokenizer.decode(ids)


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A small tokenizer built as Llama's and Mistral's are: SentencePiece-style words, a token per
    byte for the rest, and a decoder that strips the text's leading space, on which tokenizers'
    DecodeStream fails midway for some id sequences."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for word in ["\u2581", "\u2581Hello", "\u2581world", "Hello", "\u2581the", "he", "a", "\u2581\u00e9", "\u00e9"]:
        vocab[word] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_a_stream_that_fails_goes_on_in_the_window() -> None:
    """Stray bytes (a model may sample any) can make earlier text change as later bytes arrive,
    which the stream refuses; what text has been emitted stays, and what follows comes out right."""
    tokenizer = byte_fallback_tokenizer()
    tail = " the end, \u00e9t\u00e9 \u6771\u4eac \U0001f642"
    tail_ids = tokenizer.encode(tail, add_special_tokens=False)[1:]  # without the prepended word boundary
    assert tokenizer.decode(tail_ids) == tail.lstrip()
    rng = random.Random(0)
    fell_back = 0
    for _ in range(40):
        ids = [rng.randrange(3, 259) for _ in range(12)] + tail_ids
        detokenizer = Detokenizer(tokenizer)
        text = "".join(deltas(detokenizer, ids))
        fell_back += detokenizer._stream is None
        assert text.endswith(tail) and tokenizer.decode(ids).endswith(tail)
    assert fell_back > 0  # the case this test is for happened
