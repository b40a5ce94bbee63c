"""Fitted fp8 and int8 keys and values (`fp8_e4m3_fit`, `int8_fit`): each token's scale is the
candidate of least weighted error, checked against a search written out here token by token;
calibrated keys subtract their offset and decode with it; on keys with consistent outlier
channels the logits q.k come out closer to the dense ones than plain fp8's; int8_fit's equalised
keys decode within half a step of each channel's spread and, on keys with wide channels that
queries ignore, move logits far less than int8 or the offset alone; and an engine calibrates the
offset to the keys a dense engine stores."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cache.formats import KVFormat, make_format
from kvserve.cache.formats.codes import MIN_SCALE
from kvserve.cache.formats.fitted import FIT_STEPS, FittedFormat
from tests.conftest import TINY

FP8 = torch.float8_e4m3fn


def outlier_keys(n: int, heads: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Keys whose channels 3 and 40 carry a consistent magnitude (about 20 and -12) beside unit noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, dim, generator=g)
    x[..., 3] += 20
    x[..., 40] -= 12
    return x


def psd(heads: int, dim: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(heads, dim, dim, generator=g)
    return a @ a.transpose(-1, -2) / dim


def best_by_search(row: torch.Tensor, weight: torch.Tensor) -> float:
    """The least e^T W e over the candidate scales of one token and head, one scale at a time, in fp64."""
    amax = row.abs().max().item()
    best = float("inf")
    for j in range(FIT_STEPS):
        target = 448 * 2.0 ** (-j / FIT_STEPS)
        half = torch.tensor(max(amax / target, MIN_SCALE), dtype=torch.float16)
        if half.double() < amax / target:  # rounded up, so that amax stays within the codes
            half = torch.nextafter(half, torch.tensor(float("inf"), dtype=torch.float16))
        scale = half.double()
        codes = (row.double() / scale).clamp(-448, 448).float().to(FP8).double()
        err = codes * scale - row.double()
        best = min(best, (err @ weight.double() @ err).item())
    return best


def queries_and_moment(heads: int, dim: int, seed: int, scaled: dict[int, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """512 random queries [n, heads, dim], channel c multiplied by scaled[c], and their second
    moment [heads, dim, dim]."""
    queries = torch.randn(512, heads, dim, generator=torch.Generator().manual_seed(seed))
    for channel, factor in scaled.items():
        queries[..., channel] *= factor
    return queries, torch.einsum("nhd,nhe->hde", queries, queries) / len(queries)


def logit_error(f: KVFormat, q: torch.Tensor, keys: torch.Tensor) -> float:
    """Mean squared change of q.k when `keys` go through format `f`."""
    decoded = f.decode(f.encode(keys), torch.float32).double()
    return torch.einsum("qhd,khd->hqk", q.double(), decoded - keys.double()).square().mean().item()


def test_each_scale_is_the_best_candidate_under_the_weight() -> None:
    x = outlier_keys(6, 2, 64)
    offset, weight = x.mean(0), psd(2, 64)
    fmt = make_format("fp8_e4m3_fit", "k").calibrated(offset, weight, torch.ones(2, 64))
    f = fmt.encode(x)
    y = fmt.decode(f, torch.float32)
    # Decoding is code times scale plus the offset, read by hand from the fields.
    torch.testing.assert_close(y, f["codes"].float() * f["scale"].float()[..., None] + offset, rtol=0, atol=1e-6)
    remainder = x - offset
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            err = (f["codes"][t, h].double() * f["scale"][t, h].double() - remainder[t, h].double())
            got = (err @ weight[h].double() @ err).item()
            want = best_by_search(remainder[t, h], weight[h])
            assert got == pytest.approx(want, rel=1e-4, abs=1e-9)


@pytest.mark.parametrize("name", ["fp8_e4m3_fit", "int8_fit"])
def test_a_long_prompt_encodes_in_chunks_as_its_tokens_do_one_by_one(name: str) -> None:
    """1,100 tokens of 2 heads x 64 are encoded in chunks of 512 (the candidates' copies bounded):
    each token's error is the least the search finds for it alone (the same candidate, but for a
    near-tie that the sums' order may break either way)."""
    x = outlier_keys(1100, 2, 64, seed=11)
    weight = psd(2, 64)
    fmt = make_format(name, "k").calibrated(x.mean(0), weight, x.std(0))
    whole = fmt.decode(fmt.encode(x), torch.float32)

    def cost(y: torch.Tensor, t: int) -> list[float]:
        err = ((y - x[t]) / fmt.spread).double() if fmt.spread is not None else (y - x[t]).double()
        return [(err[h] @ fmt.weight[h].double() @ err[h]).item() for h in range(2)]

    for t in (0, 511, 512, 1023, 1024, 1099):
        alone = fmt.decode(fmt.encode(x[t:t + 1]), torch.float32)[0]
        assert cost(whole[t], t) == pytest.approx(cost(alone, t), rel=1e-4, abs=1e-9)
    none = fmt.encode(x[:0])
    assert none["codes"].shape == (0, 2, 64) and none["scale"].shape == (0, 2)


def test_values_fit_plain_squared_error_and_never_lose_to_absmax_fp8() -> None:
    """Values take no calibration; the absmax scale is among the candidates, so no token's error grows."""
    x = outlier_keys(50, 3, 64)
    fitted = make_format("fp8_e4m3_fit", "v")
    plain = make_format("fp8_e4m3", "v")
    got = (fitted.decode(fitted.encode(x), torch.float32) - x).square().sum(-1)
    absmax = (plain.decode(plain.encode(x), torch.float32) - x).square().sum(-1)
    assert (got <= absmax * (1 + 1e-6)).all()
    assert got.sum() < 0.5 * absmax.sum()  # measured: 0.25 of absmax's
    for t in range(3):
        assert got[t, 0].item() == pytest.approx(best_by_search(x[t, 0], torch.eye(64)), rel=1e-4)


def test_calibrated_keys_move_logits_less_than_absmax_fp8() -> None:
    """Against dense logits q.k: queries that look at the outlier channels (as real ones do), the
    format calibrated on other keys of the same kind and on those queries' second moment."""
    heads, dim = 2, 64
    calibration = outlier_keys(256, heads, dim, seed=2)
    queries, moment = queries_and_moment(heads, dim, 3, {3: 4, 40: 3})
    fmt = make_format("fp8_e4m3_fit", "k").calibrated(calibration.mean(0), moment, torch.ones(heads, dim))
    keys, q = outlier_keys(128, heads, dim, seed=4), queries[:64]
    fit, fp8, int8 = (logit_error(f, q, keys) for f in (fmt, make_format("fp8_e4m3", "k"), make_format("int8", "k")))
    # Measured: fit 0.030, fp8 1.01, int8 0.153 (fitted without the offset 0.149): the offset
    # leaves unit noise to encode, the fitted scale puts the error where queries do not look.
    assert fit < fp8 / 20 and fit < int8 / 3


def test_keys_calibrated_for_other_heads_are_refused() -> None:
    fmt = make_format("fp8_e4m3_fit", "k").calibrated(torch.zeros(2, 64), torch.eye(64).expand(2, 64, 64),
                                                   torch.ones(2, 64))
    assert fmt.bytes_per_token(2, 64, 16) == 2 * (64 + 2)
    with pytest.raises(ValueError, match="calibrated for"):
        fmt.fields(3, 64, 16)


@pytest.mark.parametrize("name", ["fp8_e4m3_fit", "int8_fit"])
def test_an_engine_calibrates_the_offset_to_the_keys_a_dense_engine_stores(tiny_llm: Callable[..., LLM],
                                                                           name: str) -> None:
    from kvserve.engine.kv_calibration import calibration_tokens

    llm = tiny_llm(kv_cache_dtype=name, kv_calibration_tokens=100)
    ids = calibration_tokens(None, TINY.vocab_size, 100, seed=0, data="calibration")
    dense = tiny_llm()
    dense.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)
    for layer, (k, _) in zip(llm.engine.pool.kv, dense.engine.pool.layers):
        keys, values = layer.formats
        stored = k.flatten(0, 1)[:100].float()
        torch.testing.assert_close(keys.offset, stored.mean(0), rtol=1e-5, atol=1e-6)
        weight = keys.weight
        assert weight.shape == (TINY.num_kv_heads, TINY.head_dim, TINY.head_dim)
        torch.testing.assert_close(weight, weight.transpose(-1, -2))
        assert (torch.linalg.eigvalsh(weight.double()) > -1e-6).all()  # a second moment: PSD
        if name == "int8_fit":  # the largest deviation from the mean, floored at the head's mean / 8
            spread = (stored - stored.mean(0)).abs().amax(0)
            spread = spread.maximum(spread.mean(-1, keepdim=True) / 8)
            torch.testing.assert_close(keys.spread, spread, rtol=1e-5, atol=1e-6)
        else:
            assert keys.spread is None
        assert values.offset is None and values.weight is None and values.spread is None
    out = llm.generate([ids[:40]], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert len(out[0].token_ids) == 8


def gemma_like_keys(n: int, heads: int, dim: int, seed: int) -> torch.Tensor:
    """Unit noise, and as in Gemma 3's layer 11: channel 7 at about -72 +- 20 and channel 50 at
    about 30 +- 15, whose consistent part an offset removes but whose spread it cannot."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, dim, generator=g)
    x[..., 7] = -72 + 20 * torch.randn(n, heads, generator=g)
    x[..., 50] = 30 + 15 * torch.randn(n, heads, generator=g)
    return x


def test_int8_fit_decodes_within_half_a_step_of_each_channel_spread() -> None:
    """Codes times scale, times the channel's spread, plus the offset; each entry within half of
    scale times its spread (int8 rounding, nothing clipped); a channel constant in calibration is
    divided by a floor of its head's mean spread / 8, not by zero."""
    heads, dim = 2, 64
    spread = torch.rand(heads, dim, generator=torch.Generator().manual_seed(5)) + 0.5
    spread[0, 9] = 0.0
    offset = torch.randn(heads, dim)
    fmt = make_format("int8_fit", "k").calibrated(offset, torch.eye(dim).expand(heads, dim, dim), spread)
    floored = spread.clone()
    floored[0, 9] = spread[0].mean() / 8
    torch.testing.assert_close(fmt.spread, floored)
    x = gemma_like_keys(40, heads, dim, seed=6)
    fields = fmt.encode(x)
    y = fmt.decode(fields, torch.float32)
    assert fields["codes"].dtype == torch.int8 and fields["codes"].abs().max() <= 127
    scale = fields["scale"].float()[..., None]
    torch.testing.assert_close(y, fields["codes"].float() * scale * floored + offset, rtol=1e-6, atol=1e-5)
    assert ((y - x).abs() <= scale * floored / 2 * (1 + 1e-5) + 1e-5).all()


def test_int8_fit_keys_move_logits_less_than_int8_and_than_fitting_without_equalising() -> None:
    """Queries that look at the unit channels, not at the large ones (as Gemma's do): int8's step
    is set by channel 7 for all; the offset alone leaves its spread setting it; equalised, each
    channel's step follows its own spread."""
    heads, dim = 2, 64
    calibration = gemma_like_keys(512, heads, dim, seed=7)
    queries, moment = queries_and_moment(heads, dim, 8, {7: 0.05, 50: 0.05})
    mean = calibration.mean(0)
    spread = (calibration - mean).abs().amax(0)
    keys, q = gemma_like_keys(128, heads, dim, seed=9), queries[:64]
    equalised = logit_error(make_format("int8_fit", "k").calibrated(mean, moment, spread), q, keys)
    offset_only = logit_error(FittedFormat("int8 offset", torch.int8, calibrate=True, offset=mean, weight=moment),
                              q, keys)
    int8 = logit_error(make_format("int8", "k"), q, keys)
    # Measured: equalised 0.0021, offset and fit alone 0.17, int8 1.9.
    assert equalised < offset_only / 20 and equalised < int8 / 200
