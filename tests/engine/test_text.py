"""Text-level behaviour on the real tokenizer: streaming, stop strings, EOS, chat template."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams

pytestmark = pytest.mark.model


def test_stream_deltas_add_up_to_the_final_text(smol: LLM) -> None:
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    deltas = [o.delta_text for o in smol.stream("Once upon a time", params)]
    final = smol.generate(["Once upon a time"], params, use_tqdm=False)[0]
    assert "".join(deltas) == final.text == smol.tokenizer.decode(final.token_ids, skip_special_tokens=True)
    assert len(deltas) == 24


def test_stop_string_truncates_text(smol: LLM) -> None:
    prompt = "1, 2, 3, 4,"
    free = smol.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                         use_tqdm=False)[0]
    stop = free.text.strip().split(",")[2].strip()  # a number a few tokens in
    out = smol.generate([prompt], SamplingParams(max_tokens=16, temperature=0, stop=[stop]),
                        use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[:free.text.index(stop)]
    assert smol.engine.kv_usage().used == 0


def test_eos_ends_a_chat_reply(smol: LLM) -> None:
    prompt = smol.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}],
                                                add_generation_prompt=True, tokenize=False)
    out = smol.generate([prompt], SamplingParams(max_tokens=64, temperature=0), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == smol.tokenizer.eos_token_id
    assert out.text and "<|im_end|>" not in out.text


def test_a_prompt_with_a_lone_surrogate_is_refused_naming_the_prompt(smol: LLM) -> None:
    with pytest.raises(ValueError, match=r"^prompt: not valid Unicode \(lone surrogate at character 6\)"):
        smol.generate(["Hello \ud800"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert smol.engine.kv_usage().used == 0 and not smol.engine.has_unfinished()
