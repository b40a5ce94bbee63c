"""The runner's only inputs are a step plan and the model: plans written by hand (no scheduler, no
block manager, no sequence) run to the logits HF transformers gives for the same tokens."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve import LLM
from kvserve.cache.block_ops import BlockOps
from kvserve.engine.step_plan import SeqSpan, StepPlan
from kvserve.model.loader import hf_state_dict, load_model
from tests.conftest import TINY

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def hf_tiny() -> LlamaForCausalLM:
    """HF's Llama with the weights a tiny_llm engine draws (seed 0)."""
    model = LlamaForCausalLM(LlamaConfig(**TINY.to_hf_dict())).eval()
    model.load_state_dict(hf_state_dict(load_model(TINY, torch.float32, CPU, seed=0).model), strict=False)
    return model


def hf_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_hand_written_plans_prefill_then_decode(tiny_llm: Callable[..., LLM], hf_tiny: LlamaForCausalLM,
                                                backend: str) -> None:
    """Two sequences in blocks chosen by hand (not in allocation order, one table ending in a
    partly used block): a prefill of both with prompt-logprob rows, then one decode step of each
    that reads the prefilled pages."""
    runner = tiny_llm(attention_backend=backend, block_size=4).engine.runner
    a, b = [5, 17, 3, 99, 42, 8, 61], [7, 7, 120, 1, 64]
    table_a, table_b = [6, 2], [9, 4]
    prefill = StepPlan([SeqSpan(0, len(a), (table_a,), prompt_rows=(0, len(a) - 1)), SeqSpan(0, len(b), (table_b,))],
                       a + b, BlockOps(), None)
    got = runner.forward(prefill)
    want_a, want_b = hf_logits(hf_tiny, a), hf_logits(hf_tiny, b)
    torch.testing.assert_close(got.logits, torch.stack([want_a[-1], want_b[-1]]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.prompt_logits, want_a[:-1], atol=1e-4, rtol=1e-4)

    next_a, next_b = 11, 33
    decode = StepPlan([SeqSpan(len(a), 1, (table_a,)), SeqSpan(len(b), 1, (table_b + [1],))],
                      [next_a, next_b], BlockOps(), None)
    got = runner.forward(decode)
    want = torch.stack([hf_logits(hf_tiny, a + [next_a])[-1], hf_logits(hf_tiny, b + [next_b])[-1]])
    torch.testing.assert_close(got.logits, want, atol=1e-4, rtol=1e-4)
    assert got.prompt_logits.shape[0] == 0


def test_a_plans_block_copy_runs_before_its_forward(tiny_llm: Callable[..., LLM], hf_tiny: LlamaForCausalLM) -> None:
    """Copy-on-write named in the plan's BlockOps: a sequence continues from a copy of another's
    last block, written by the same step's move."""
    runner = tiny_llm(block_size=4).engine.runner
    prompt = [5, 17, 3, 99, 42, 8]
    runner.forward(StepPlan([SeqSpan(0, len(prompt), ([0, 1],))], prompt, BlockOps(), None))
    forked = StepPlan([SeqSpan(len(prompt), 1, ([0, 3],))], [77], BlockOps(copies=((1, 3),)), None)
    got = runner.forward(forked).logits[0]
    torch.testing.assert_close(got, hf_logits(hf_tiny, prompt + [77])[-1], atol=1e-4, rtol=1e-4)
