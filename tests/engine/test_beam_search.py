"""Beam search: HF transformers' num_beams on the real model; block sharing on a tiny one."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time,", "def add(a, b):", "My favourite food is"]


def hf_beams(hf: Any, ids: list[int], max_new_tokens: int, length_penalty: float) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), num_beams=4, do_sample=False,
                          max_new_tokens=max_new_tokens, length_penalty=length_penalty,
                          early_stopping=False, pad_token_id=2, eos_token_id=2)[0, len(ids):].tolist()
    return out[:out.index(2) + 1] if 2 in out else out


@pytest.mark.model
@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_beam_search_equals_hf_num_beams(smol: LLM, hf_smol: Any, length_penalty: float) -> None:
    params = SamplingParams(beam_width=4, max_tokens=16, length_penalty=length_penalty)
    outs = smol.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        expected = hf_beams(hf_smol, smol.tokenizer.encode(prompt), 16, length_penalty)
        assert out.token_ids == expected, prompt
    assert smol.engine.kv_usage().used == 0


def test_beams_share_blocks_and_free_them(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm()
    engine = llm.engine
    engine.add_request(list(range(1, 41)), SamplingParams(beam_width=4, max_tokens=12, ignore_eos=True))
    most_used, most_unshared = 0, 0
    while engine.has_unfinished():
        outs = engine.step()
        usage = engine.kv_usage()
        most_used, most_unshared = max(most_used, usage.used), max(most_unshared, usage.unshared_blocks)
    assert len(outs) == 1 and len(outs[0].token_ids) == 12 and outs[0].finish_reason == "length"
    assert most_unshared == 4 * 4 and most_used < most_unshared  # 4 beams x 4 blocks of 52 tokens


def test_beam_search_survives_preemption(tiny_llm: Callable[..., LLM]) -> None:
    params = SamplingParams(beam_width=3, max_tokens=16, ignore_eos=True)
    prompts = [list(range(1, 30)), list(range(40, 75)), list(range(80, 100))]
    expected = [o.token_ids for o in tiny_llm().generate(prompts, params, use_tqdm=False)]
    small = tiny_llm(kv_cache_memory="96KiB", enable_prefix_caching=False)
    assert [o.token_ids for o in small.generate(prompts, params, use_tqdm=False)] == expected
    assert small.engine.scheduler.num_preemptions > 0
