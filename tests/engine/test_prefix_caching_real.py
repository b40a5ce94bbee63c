"""Prefix caching on the real model: a long shared system prompt, outputs unchanged."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams

pytestmark = pytest.mark.model

SYSTEM = ("You are a meticulous assistant for a library. Answer questions about opening hours, "
          "borrowing rules, late fees and the reading rooms. Be brief, polite and precise, and "
          "never invent a rule that the library does not have. ")
QUESTIONS = ["When do you open on Sunday?", "How many books can I borrow?",
             "What is the late fee?", "Can I eat in the reading room?"]


def test_shared_system_prompt_hits_the_cache_with_identical_outputs() -> None:
    prompts = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(max_tokens=16, temperature=0)
    results = {}
    for enabled in (True, False):
        llm = LLM(dtype="float32", device="cpu", kv_cache_memory="128MiB", max_model_len=512,
                  max_num_seqs=1, enable_prefix_caching=enabled)
        texts = [llm.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
                 for m in prompts]
        outs = llm.generate(texts, params, use_tqdm=False)
        results[enabled] = ([o.token_ids for o in outs], llm.engine.tokens_computed,
                            llm.engine.block_manager.prefix_stats)
        assert llm.engine.kv_usage().used == 0
    assert results[True][0] == results[False][0]
    stats = results[True][2]
    assert stats.hit_rate > 0.5 and results[False][2].hit_rate == 0
    assert results[True][1] == results[False][1] - stats.cached_tokens
