"""LLM.chat: conversations through the model's chat template, as vLLM's LLM.chat takes them."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.model
def test_chat_prompts_are_the_templates_ids_as_hf_renders_them(smol: LLM) -> None:
    want = smol.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)  # HF's own tokenization
    one = smol.chat(MESSAGES, GREEDY, use_tqdm=False)
    assert len(one) == 1 and one[0].prompt_token_ids == want
    assert one[0].token_ids == smol.generate(want, GREEDY, use_tqdm=False)[0].token_ids
    two = smol.chat([MESSAGES, MESSAGES[1:]], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in two][0] == one[0].token_ids
    assert two[1].prompt_token_ids == smol.tokenizer.apply_chat_template(MESSAGES[1:], add_generation_prompt=True,
                                                                            return_dict=False)


@pytest.mark.model
@pytest.mark.parametrize("messages, field", [
    ([], "messages: must be"),
    ("Hello", "messages: must be"),
    ([{"role": "user"}], "messages.0.content"),
    ([{"role": "robot", "content": "hi"}], "messages.0.role"),
    ([MESSAGES, [{"role": "user", "content": 3}]], "messages.1.0.content"),
])
def test_bad_messages_are_refused_naming_the_field(smol: LLM, messages: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        smol.chat(messages, GREEDY, use_tqdm=False)  # type: ignore[arg-type]
    assert not smol.engine.has_unfinished()
