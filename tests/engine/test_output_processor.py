"""Stop conditions and what a running output shows, against the whole text searched by brute force,
on a character-level tokenizer (one token per character, so the reference is plain string work)."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from kvserve.engine.detokenizer import Detokenizer
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.sequence import OutputState, Sequence
from kvserve.sampling_params import MAX_STOP_CHARS, MAX_STOPS, SamplingParams

CHARS = "ab c"
EOS = 1
VOCAB = {"<unk>": 0, "</s>": EOS} | {c: i + 2 for i, c in enumerate(CHARS)}


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


def run(tokenizer: PreTrainedTokenizerFast, text: str, params: SamplingParams,
        max_model_len: int = 1000) -> tuple[Sequence, list[str | None]]:
    """Feeds `text` a character (token) at a time until the sequence finishes; returns it and the
    text of every output (None where there was none)."""
    processor = OutputProcessor(EOS, max_model_len)
    seq = Sequence("r", [2], params, seed=0, out=OutputState(Detokenizer(tokenizer)))
    shown: list[str | None] = []
    for char in text:
        seq.output_token_ids.append(VOCAB[char])
        processor.append_text(seq, VOCAB[char])
        out = processor.output(seq)
        shown.append(None if out is None else out.text)
        if out is not None:
            assert out.text.endswith(out.delta_text) and out.finish_reason == seq.out.finish_reason
        if seq.out.finish_reason is not None:
            break
    return seq, shown


def first_stop(text: str, stop: list[str]) -> int | None:
    """Where generation cut at the first token that completes a stop string cuts the text."""
    for end in range(1, len(text) + 1):
        hits = [i for s in stop if (i := text[:end].find(s)) >= 0]
        if hits:
            return min(hits)
    return None


def test_stop_strings_cut_where_the_whole_text_first_holds_one(tokenizer: PreTrainedTokenizerFast) -> None:
    rng = random.Random(0)
    hits = 0
    for _ in range(300):
        # One search of their alternation: a regex character in a stop string is itself ("a."
        # would match "ab" otherwise), and the earliest start wins whatever the list's order.
        stop = [rng.choice(["ab", "bab", "a c", "cc", "baab", "b", "a.", "b+", "(c"])
                for _ in range(rng.randint(1, MAX_STOPS))]
        text = "".join(rng.choice(CHARS) for _ in range(rng.randint(1, 30)))
        seq, shown = run(tokenizer, text, SamplingParams(max_tokens=100, stop=stop))
        cut = first_stop(text, stop)
        hits += cut is not None
        assert seq.out.finish_reason == ("stop" if cut is not None else None)
        final = text if cut is None else text[:cut]
        assert seq.out.text == final
        # A running output never shows what a stop string later takes back, and its text grows.
        running = [s for s in shown if s is not None]
        assert all(final.startswith(s) for s in running)
        assert all(len(a) <= len(b) for a, b in zip(running, running[1:]))
    assert hits > 100  # both outcomes were exercised


def test_eos_stop_ids_and_length(tokenizer: PreTrainedTokenizerFast) -> None:
    processor = OutputProcessor(EOS, max_model_len=6)
    cases = [(SamplingParams(max_tokens=9), [2, EOS], "stop"),
             (SamplingParams(max_tokens=9, ignore_eos=True), [2, EOS, 3], None),
             (SamplingParams(max_tokens=9, stop_token_ids=[4]), [2, 3, 4], "stop"),
             (SamplingParams(max_tokens=3), [2, 3, 3], "length"),
             (SamplingParams(max_tokens=9), [2, 2, 2, 2, 2], "length")]  # 1 prompt + 5 = max_model_len
    for params, tokens, reason in cases:
        seq = Sequence("r", [2], params, seed=0, out=OutputState(Detokenizer(tokenizer)))
        for i, token in enumerate(tokens):
            assert seq.out.finish_reason is None, (params, tokens, i)
            seq.output_token_ids.append(token)
            processor.append_text(seq, token)
        assert seq.out.finish_reason == reason, (params, tokens)


def test_final_kind_has_one_output_with_the_whole_text(tokenizer: PreTrainedTokenizerFast) -> None:
    seq, shown = run(tokenizer, "ab cab", SamplingParams(max_tokens=6, output_kind="final"))
    assert shown == [None] * 5 + ["ab cab"] and seq.out.finish_reason == "length"


@pytest.mark.parametrize("stop", [["x"] * (MAX_STOPS + 1), ["x" * (MAX_STOP_CHARS + 1)], ["ab"] * 26_000])
def test_stop_strings_are_capped_in_number_and_length(stop: list[str]) -> None:
    # Unbounded, ~2.6 MB of stop strings in one request (the last case) slowed every other
    # request 4x: each was searched at every token of every sample.
    with pytest.raises(ValueError, match=f"^SamplingParams.stop: at most {MAX_STOPS} stop strings of at most "
                                         f"{MAX_STOP_CHARS} characters"):
        SamplingParams(stop=stop)
    assert SamplingParams(stop=["x" * MAX_STOP_CHARS] * MAX_STOPS).stop_hold == MAX_STOP_CHARS - 1
