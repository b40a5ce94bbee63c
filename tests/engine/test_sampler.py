"""Sampler: greedy, top-k/top-p filtering against brute force, seeding, and the drawn distribution."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvserve import LLM
from kvserve.engine.sampler import _top_k_top_p, sample
from kvserve.sampling_params import SamplingParams


def greedy_params() -> SamplingParams:
    return SamplingParams(temperature=0.0)


def flat_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Nearly uniform logits: a sampled token almost never equals the argmax, so any test that
    expects argmax (or expects two draws to agree) fails if the wrong path is taken."""
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 0.01


def top_k_probs(row: list[float], top_k: int) -> tuple[list[int], list[float]]:
    """Indices in descending logit order (the k largest, or all for k = 0) and their softmax
    probabilities renormalised over those, in float64."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    if top_k > 0:
        order = order[:top_k]
    m = max(row[i] for i in order)
    weights = [math.exp(row[i] - m) for i in order]
    total = sum(weights)
    return order, [w / total for w in weights]


def brute_force_keep(row: list[float], top_k: int, top_p: float) -> set[int]:
    """Indices kept by top-k then top-p, worked with a Python loop in float64.

    top-k keeps the k largest logits (0 = all). top-p then renormalises over those and keeps the
    smallest prefix, in descending order, whose mass reaches p: a token stays while the mass of
    the tokens before it is still below p.
    """
    order, probs = top_k_probs(row, top_k)
    kept: list[int] = []
    mass = 0.0
    for i, p in zip(order, probs):
        if mass >= top_p:
            break
        kept.append(i)
        mass += p
    return set(kept)


def prefix_margin(row: list[float], top_k: int, top_p: float) -> float:
    """How close any exclusive prefix mass comes to p; a tiny margin would make the float32 and
    float64 answers legitimately differ, so the tests check it is comfortably large."""
    _, probs = top_k_probs(row, top_k)
    mass, margin = 0.0, float("inf")
    if top_p >= 1:
        return margin  # p = 1 keeps everything: no boundary to be near
    for p in probs:
        margin = min(margin, abs(mass - top_p))
        mass += p
    return margin


def test_all_greedy_is_argmax() -> None:
    logits = flat_logits(16, 50, seed=0)
    out = sample(logits, [greedy_params()] * 16, seeds=list(range(16)), positions=[3] * 16)
    assert out.tolist() == logits.argmax(dim=-1).tolist()


def test_temperature_zero_rows_stay_greedy_in_mixed_batch() -> None:
    # Even rows greedy, odd rows sampled with filters, so the batch goes through temperature,
    # top-k/top-p and the noise race; the greedy rows must still give their argmax.
    rows, vocab = 32, 200
    logits = flat_logits(rows, vocab, seed=1)
    params = [greedy_params() if i % 2 == 0 else SamplingParams(temperature=0.7, top_k=50, top_p=0.9)
              for i in range(rows)]
    out = sample(logits, params, seeds=list(range(rows)), positions=list(range(rows)))
    argmax = logits.argmax(dim=-1)
    assert out[0::2].tolist() == argmax[0::2].tolist()
    # The sampled rows really sampled: with flat logits most miss the argmax.
    assert (out[1::2] != argmax[1::2]).sum() >= 10


@pytest.mark.parametrize("top_k,top_p", [
    (1, 1.0), (3, 1.0), (17, 1.0), (63, 1.0), (64, 1.0), (100, 1.0),  # top-k only (100 > vocab)
    (0, 0.05), (0, 0.3), (0, 0.77), (0, 0.999),                      # top-p only
    (5, 0.5), (20, 0.3), (40, 0.95), (2, 0.99),                      # both
])
def test_top_k_top_p_matches_brute_force(top_k: int, top_p: float) -> None:
    rows, vocab = 12, 64
    gen = torch.Generator().manual_seed(top_k * 1000 + int(top_p * 1000))
    # Scale 1.5 keeps every probability far above float32 rounding of the prefix sums (the
    # p = 1 rounding case has its own test below), while top-k and top-p still cut deep.
    logits = torch.randn(rows, vocab, generator=gen) * 1.5
    params = [SamplingParams(top_k=top_k, top_p=top_p)] * rows
    out = _top_k_top_p(logits.clone(), params)
    for r in range(rows):
        row = logits[r].tolist()
        assert prefix_margin(row, top_k, top_p) > 1e-5
        expected = brute_force_keep(row, top_k, top_p)
        kept = set(torch.isfinite(out[r]).nonzero().flatten().tolist())
        assert kept == expected, f"row {r}"
        # Kept logits are untouched; dropped ones are -inf.
        idx = sorted(kept)
        assert torch.equal(out[r, idx], logits[r, idx])
        assert torch.all(out[r][~torch.isfinite(out[r])] == float("-inf"))


def test_top_k_top_p_per_row_params() -> None:
    # Each row uses its own settings, in one call.
    settings = [(0, 1.0), (1, 1.0), (0, 0.4), (7, 0.6), (30, 1.0), (0, 0.9)]
    logits = torch.randn(len(settings), 40, generator=torch.Generator().manual_seed(7)) * 1.5
    out = _top_k_top_p(logits.clone(), [SamplingParams(top_k=k, top_p=p) for k, p in settings])
    for r, (k, p) in enumerate(settings):
        row = logits[r].tolist()
        assert prefix_margin(row, k, p) > 1e-5
        kept = set(torch.isfinite(out[r]).nonzero().flatten().tolist())
        assert kept == brute_force_keep(row, k, p), f"row {r}"


def test_top_p_hand_worked() -> None:
    # probs 0.4, 0.3, 0.2, 0.1 (in shuffled vocab order). p = 0.65: 0.4 < 0.65 so 0.3 stays,
    # 0.7 >= 0.65 so the rest go. p = 0.75: 0.7 < 0.75 so 0.2 also stays.
    logits = torch.log(torch.tensor([[0.2, 0.4, 0.1, 0.3]] * 3))
    out = _top_k_top_p(logits.clone(), [SamplingParams(top_p=0.65), SamplingParams(top_p=0.75),
                                        SamplingParams(top_p=0.3)])
    assert torch.isfinite(out).tolist() == [[False, True, False, True],
                                            [True, True, False, True],
                                            [False, True, False, False]]


def test_top_p_one_keeps_every_token() -> None:
    # top_p = 1.0 is the "off" value. One dominant logit makes the float32 mass of the first token
    # round to exactly 1.0, and `prefix mass >= top_p` then drops every other token. sample() runs
    # the filter on all rows as soon as any row in the batch uses top-k/top-p, so a top_p = 1 row's
    # distribution (and in principle its seeded draw) depends on its neighbours.
    logits = torch.tensor([[20.0, 0.0, 0.0, 0.0], [0.0, 20.0, 1.0, -1.0]])
    out = _top_k_top_p(logits.clone(), [SamplingParams(top_p=1.0), SamplingParams(top_k=3, top_p=1.0)])
    assert torch.isfinite(out).tolist() == [[True, True, True, True], [True, True, True, False]]


def test_same_seed_and_position_independent_of_batch() -> None:
    vocab = 500
    logits = flat_logits(6, vocab, seed=3)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(6)]
    seeds, positions = [11, 22, 33, 44, 55, 66], [0, 5, 5, 9, 100, 3]
    alone = [sample(logits[i:i + 1], [params[i]], [seeds[i]], [positions[i]]).item() for i in range(6)]
    together = sample(logits, params, seeds, positions).tolist()
    assert together == alone
    # Reversed order, plus greedy and filtered rows mixed in (which sends the whole batch
    # through _top_k_top_p): each original row still draws the same token.
    order = [5, 4, 3, 2, 1, 0]
    extra = flat_logits(2, vocab, seed=4)
    mixed_logits = torch.cat([logits[order], extra])
    mixed_params = [params[i] for i in order] + [greedy_params(), SamplingParams(top_k=3, top_p=0.5)]
    mixed = sample(mixed_logits, mixed_params, [seeds[i] for i in order] + [1, 2],
                   [positions[i] for i in order] + [0, 0]).tolist()
    assert mixed[:6] == [alone[i] for i in order]
    # And the draws are not all the same token (else the comparison above proves nothing).
    assert len(set(alone)) > 1


def test_different_positions_give_different_draws() -> None:
    # Uniform over 1000 tokens: 200 independent draws give about 181 distinct tokens; draws that
    # ignored the position would all coincide.
    n, vocab = 200, 1000
    logits = torch.zeros(n, vocab)
    params = [SamplingParams(temperature=1.0)] * n
    same_seed = sample(logits, params, seeds=[42] * n, positions=list(range(n)))
    assert len(set(same_seed.tolist())) > 150
    same_pos = sample(logits, params, seeds=list(range(n)), positions=[7] * n)
    assert len(set(same_pos.tolist())) > 150
    # Repeating the call repeats the draws exactly.
    assert torch.equal(same_seed, sample(logits, params, seeds=[42] * n, positions=list(range(n))))


@pytest.mark.parametrize("kwargs,expected", [
    ({"temperature": 1.0}, [0.1, 0.2, 0.3, 0.4]),
    # Temperature 0.5 squares the probabilities: 1, 4, 9, 16 over 30.
    ({"temperature": 0.5}, [1 / 30, 4 / 30, 9 / 30, 16 / 30]),
    ({"temperature": 1.0, "top_k": 2}, [0, 0, 3 / 7, 4 / 7]),
    # top_p 0.75: prefix masses 0, 0.4, 0.7 are below 0.75, so 0.4, 0.3, 0.2 stay.
    ({"temperature": 1.0, "top_p": 0.75}, [0, 2 / 9, 3 / 9, 4 / 9]),
])
def test_empirical_distribution(kwargs: dict, expected: list[float]) -> None:
    n = 4000
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4])).expand(n, 4).contiguous()
    params = [SamplingParams(**kwargs)] * n
    out = sample(logits, params, seeds=list(range(n)), positions=[17] * n)
    freq = torch.bincount(out, minlength=4).double() / n
    for got, want in zip(freq.tolist(), expected):
        if want == 0:
            assert got == 0  # filtered tokens are never drawn
        else:
            assert abs(got - want) < 0.03, (freq.tolist(), expected)


def test_large_seed_accepted_by_params_can_be_sampled() -> None:
    # SamplingParams accepts any int seed. The sampler mixes it as seed * 1_000_003 + position and
    # hands that to torch.Generator.manual_seed, which only takes values below 2**64; so any
    # seed from about 2**44 up makes sample() raise mid-step. Either the params must reject
    # such a seed (naming the field) or the sampler must draw with it.
    seed = 2**50
    try:
        params = SamplingParams(temperature=1.0, seed=seed)
    except ValueError as e:
        assert "seed" in str(e)
        return
    logits = flat_logits(1, 10, seed=0)
    first = sample(logits, [params], [seed], [0])
    assert torch.equal(first, sample(logits, [params], [seed], [0]))


def test_penalties_worked_by_hand() -> None:
    from kvserve.engine.penalties import apply_penalties
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0]])
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(repetition_penalty=2.0),
              SamplingParams(logit_bias={2: 5.0, 0: -100.0})]
    prompts, outputs = [[3], [1, 2], [0]], [[0, 0, 2], [0], [1]]
    out = apply_penalties(logits, params, prompts, outputs)
    # Row 0: token 0 appeared twice in the output (-0.5 - 2 * 0.25), token 2 once (-0.5 - 0.25);
    # the prompt's token 3 does not count.
    assert out[0].tolist() == [1.0, -1.0, -0.25, 3.0]
    # Row 1: tokens 0 (output), 1 and 2 (prompt) seen: 2 / 2, -1 * 2, 0.5 / 2; token 3 unseen.
    assert out[1].tolist() == [1.0, -2.0, 0.25, 3.0]
    assert out[2].tolist() == [-99.0, 1.0, 6.0, 1.0]
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5, 3.0]))  # the input is untouched


def test_logit_bias_steers_generation_and_logprobs_follow(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm()
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0, logit_bias={77: 100.0},
                                                   logprobs=0, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == [77] * 5
    assert all(t.logprob > -1e-3 for t in out.logprobs)  # the distribution sampled from: biased


def test_an_integer_logit_bias_steers_as_its_float_does(tiny_llm: Callable[..., LLM]) -> None:
    # {77: 100} passed validation, then failed the whole step (index_add_ of a Long tensor to Float
    # logits): every request of the batch ended with it.
    llm = tiny_llm()
    params = [SamplingParams(max_tokens=5, temperature=0, logit_bias=bias, ignore_eos=True)
              for bias in ({77: 100}, {77: 100.0}, None)]
    outs = llm.generate([[1, 2, 3]] * 3, params, use_tqdm=False)
    assert outs[0].token_ids == outs[1].token_ids == [77] * 5 and outs[2].finish_reason == "length"


def test_a_huge_temperature_samples_from_a_valid_distribution(tiny_llm: Callable[..., LLM]) -> None:
    # The Python API keeps any finite temperature (the server holds requests to OpenAI's 0..2):
    # 1e308 is inf in fp32, and logits / inf give the uniform distribution, not NaN.
    llm = tiny_llm()
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=1e308, logprobs=2, seed=1,
                                                   ignore_eos=True), use_tqdm=False)[0]
    uniform = -math.log(llm.engine.model_config.vocab_size)
    assert all(0 <= t < llm.engine.model_config.vocab_size for t in out.token_ids)
    assert [t.logprob for t in out.logprobs] == pytest.approx([uniform] * 6)


@pytest.mark.parametrize("bad", [dict(presence_penalty=3.0), dict(frequency_penalty=float("nan")),
                                 dict(repetition_penalty=0.0), dict(logit_bias={1: 200.0}),
                                 dict(logit_bias={-1: 1.0}), dict(logit_bias={"a": 1.0})])
def test_bad_penalties_name_the_field(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="SamplingParams.(presence_penalty|frequency_penalty|repetition_penalty|logit_bias)"):
        SamplingParams(**bad)


def test_vanishing_temperature_and_top_p_give_the_argmax() -> None:
    # 1e-300 is a finite float but 0 in fp32: dividing by it, or keeping a top_p mass of it,
    # must still give the limit of the distribution (its argmax), never NaN and a random id.
    logits = flat_logits(8, 50, seed=4)
    for params in (SamplingParams(temperature=1e-300), SamplingParams(temperature=1e-6),
                   SamplingParams(top_p=1e-300), SamplingParams(top_p=1e-300, top_k=3)):
        out = sample(logits, [params] * 8, seeds=list(range(8)), positions=[5] * 8)
        assert out.tolist() == logits.argmax(dim=-1).tolist(), params


def test_extreme_repetition_penalties_keep_logits_finite() -> None:
    from kvserve.engine.penalties import apply_penalties
    logits = torch.tensor([[2.0, -1.0, 0.0, 3.0]] * 2)
    params = [SamplingParams(repetition_penalty=1e-300), SamplingParams(repetition_penalty=1e300)]
    out = apply_penalties(logits, params, prompts=[[0, 1, 2]] * 2, outputs=[[], []])
    assert torch.isfinite(out).all()
    # HF's rule, seen tokens only: positive logits divided by the penalty, negative ones multiplied.
    assert out[0, 0] > 1e20 and -1e-20 < out[0, 1] < 0 and out[0, 3] == 3.0
    assert 0 < out[1, 0] < 1e-20 and out[1, 1] < -1e20 and out[1, 3] == 3.0
    probs = torch.softmax(out / 1e-5, dim=-1)
    assert torch.isfinite(probs).all()


def test_vanishing_temperature_logprobs_are_finite(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm()
    greedy = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True),
                          use_tqdm=False)[0]
    tiny = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=1e-300, logprobs=2,
                                                    ignore_eos=True), use_tqdm=False)[0]
    assert tiny.token_ids == greedy.token_ids
    assert [t.logprob for t in tiny.logprobs] == pytest.approx([t.logprob for t in greedy.logprobs])
    assert all(math.isfinite(t.logprob) for t in tiny.logprobs)


def test_a_top_k_past_int64_is_the_whole_vocabulary(tiny_llm: Callable[..., LLM]) -> None:
    # Valid for SamplingParams, it used to overflow the sampler's tensor and fail the whole batch.
    llm = tiny_llm()
    outs = [llm.generate([[1, 2, 3]], SamplingParams(max_tokens=6, top_k=k, seed=5, ignore_eos=True),
                         use_tqdm=False)[0].token_ids for k in (0, 2**64, 10**400)]
    assert outs[0] == outs[1] == outs[2]
