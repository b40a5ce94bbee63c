"""The quality measures, against values worked by hand, and on the real model's cache path."""
from __future__ import annotations

import math

import pytest
import torch

from kvserve import LLM
from kvserve.eval.quality import KL_ROWS, compare, forced_logprobs, greedy_agreement, kl, passkey_prompts


def test_compare_against_hand_worked_values() -> None:
    ref = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]]))
    got = torch.log(torch.tensor([[[0.25, 0.5, 0.25], [0.1, 0.8, 0.1]]]))
    q = compare(got, ref, torch.tensor([[1, 1]]))
    # NLL of target 1: -log 0.5 and -log 0.8; KL(ref||got) = 0.5 log 2 + 0.25 log 0.5 at position 0.
    assert q.perplexity == pytest.approx(math.exp((math.log(2) - math.log(0.8)) / 2))
    assert q.kl == pytest.approx((0.5 * math.log(2) + 0.25 * math.log(0.5)) / 2)
    assert q.top1 == 0.5


def test_kl_in_slices_equals_the_whole_formula() -> None:
    """kl() sums in slices of KL_ROWS positions to bound its fp64 copies: over more positions than
    one slice it equals the mean of sum p (log p - log q) taken at once."""
    gen = torch.Generator().manual_seed(5)
    ref = torch.randn(3, KL_ROWS // 2 + 7, 50, generator=gen).log_softmax(-1)
    got = torch.randn(3, KL_ROWS // 2 + 7, 50, generator=gen).log_softmax(-1)
    whole = (ref.double().exp() * (ref.double() - got.double())).sum(-1).mean().item()
    assert kl(ref, got) == pytest.approx(whole, rel=1e-12) and kl(ref, ref) == 0


def test_greedy_agreement_counts_tokens_before_divergence() -> None:
    assert greedy_agreement([[1, 2, 3], [1, 9, 3], [5]], [[1, 2, 3], [1, 2, 3], [4]]) == pytest.approx((3 + 1 + 0) / 3)
    assert math.isnan(greedy_agreement([], []))  # `--greedy-prompts 0` skips the measure


class WordTokenizer:
    def encode(self, text: str) -> list[str]:
        return text.split()


def test_passkey_prompts_hide_the_key_at_seeded_depths() -> None:
    prompts = passkey_prompts(WordTokenizer(), 400, trials=6, seed=1)
    assert prompts == passkey_prompts(WordTokenizer(), 400, trials=6, seed=1)
    assert len({key for _, key in prompts}) > 1
    for prompt, key in prompts:
        assert prompt.count(key) == 2 and prompt.endswith("The pass key is")
        assert 300 <= len(prompt.split()) <= 420
    depths = {prompt.index(key) for prompt, key in prompts}
    assert len(depths) > 1


@pytest.mark.model
def test_int8_cache_is_closer_to_the_dense_cache_than_int4(smol: LLM) -> None:
    """Through the real prefill/decode path of the bundled model: the dense cache compared with
    itself is exact; int8 departs from it less than int4 does, and both only a little."""
    text = ("The tower is 324 metres tall, about the same height as an 81-storey building, and the "
            "tallest structure in Paris. Its base is square, measuring 125 metres on each side. ") * 3
    windows = [smol.tokenizer.encode(text)[:96]]
    dense = forced_logprobs(smol, windows, 48)
    targets = torch.tensor([w[48:] for w in windows])
    assert compare(forced_logprobs(smol, windows, 48), dense, targets).kl == 0
    results = {}
    for fmt in ("int8", "int4"):
        llm = LLM(dtype="float32", device="cpu", kv_cache_memory="64MiB", max_model_len=256, max_num_seqs=2,
                  kv_cache_dtype=fmt)
        results[fmt] = compare(forced_logprobs(llm, windows, 48), dense, targets)
    assert 0 < results["int8"].kl < results["int4"].kl < 0.5
    assert results["int8"].top1 >= results["int4"].top1 >= 0.8
