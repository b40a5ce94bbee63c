"""KIVI keys with bits per channel (`kivi2_mix`, `kivi4_mix`: MixedChannelFormat): the allocation
spends at most kivi's bits (2 or 4 a channel plus the wide channels), equal within RoPE pairs, more
where importance is, and minimises the modelled error (checked against every allocation of a small
head); pages cost what kivi's with the same wide channels cost; decoding matches a per-channel
quantizer written out here; and an engine runs it calibrated."""
from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cache.formats import make_format
from kvserve.cache.formats.kivi import MixedChannelFormat, allocate_bits, bit_choices


def unit_cost(bits: int) -> float:
    """A channel's modelled q.k error at `bits`, relative to its range^2 / 12: 0 bits decode the mean."""
    return 1.0 if bits == 0 else 1.0 / (2 ** bits - 1) ** 2


@pytest.mark.parametrize(("bits", "choices"), [(2, (0, 2, 3, 4)), (4, (0, 2, 3, 4, 5, 6, 7, 8))])
def test_allocation_keeps_the_budget_and_pairs_and_is_optimal_on_a_small_head(bits: int,
                                                                            choices: tuple[int, ...]) -> None:
    assert bit_choices(bits) == choices
    g = torch.Generator().manual_seed(0)
    importance = torch.rand(2, 12, generator=g) ** 4  # a few channels hold most of it
    total = bits * 12 + 4
    got = allocate_bits(importance, total, choices)
    assert (got.sum(-1) <= total).all()
    assert torch.equal(got[:, :6], got[:, 6:])  # RoPE pairs share their bits
    assert set(got.unique().tolist()) <= set(choices)
    assert (got[:, :6].sum(-1) * 2 >= total - 2).all()  # no bit left that a pair could still take
    pairs = importance[:, :6] + importance[:, 6:]
    for h in range(2):  # every allocation of 6 pairs within the budget
        norm = (pairs[h] / pairs[h].sum()).tolist()
        best = min(sum(w * unit_cost(b) for w, b in zip(norm, c))
                   for c in itertools.product(choices, repeat=6) if 2 * sum(c) <= total)
        assert sum(w * unit_cost(b) for w, b in zip(norm, got[h, :6].tolist())) <= best * 1.02


def f16(v: torch.Tensor, up: bool) -> torch.Tensor:
    """v in fp16 rounded toward +inf (up) or -inf: the format stores ranges so that they still cover the block."""
    h = v.half()
    if (h.float() < v) if up else (h.float() > v):
        h = torch.nextafter(h, torch.tensor(float("inf") if up else float("-inf"), dtype=torch.float16))
    return h.float()


def reference_roundtrip(x: torch.Tensor, bits: torch.Tensor, sink: bool) -> torch.Tensor:
    """x [T, H, D] one block, channel by channel: min-max codes over the non-sink tokens, 0 bits the mean."""
    out = torch.empty_like(x)
    body = x[1:] if sink else x
    for h in range(x.shape[1]):
        for d in range(x.shape[2]):
            b = int(bits[h, d])
            col = x[:, h, d]
            if b == 0:
                out[:, h, d] = body[:, h, d].mean().half().float()
                continue
            lo = f16(body[:, h, d].min(), up=False)
            step = f16((body[:, h, d].max() - lo) / (2 ** b - 1), up=True)
            out[:, h, d] = ((col - lo) / step).round().clamp(0, 2 ** b - 1) * step + lo
    if sink:
        out[0] = x[0].half().float()
    return out


@pytest.mark.parametrize("bits", [2, 4])
def test_decode_matches_a_per_channel_quantizer_and_kivis_price(bits: int) -> None:
    g = torch.Generator().manual_seed(1)
    heads, dim, block = 2, 16, 32
    x = torch.randn(3, block, heads, dim, generator=g) * torch.linspace(0.5, 4, dim)
    importance = torch.rand(heads, dim, generator=g) ** 3
    fmt = MixedChannelFormat(f"kivi{bits}_mix", bits, exact_sink=True, wide=8).calibrated(importance)
    assert fmt.channel_bits.max() > bits  # some channel above the base bits, whose planes decode too
    kivi = make_format(f"kivi{bits}", "k", exact_sink=True, key_wide_channels=8)
    assert fmt.bytes_per_token(heads, dim, block) == kivi.bytes_per_token(heads, dim, block)
    fields = fmt.encode(x)
    assert {k: tuple(v.shape[1:]) for k, v in fields.items()} == {k: s for k, (s, _) in
                                                                   fmt.fields(heads, dim, block).items()}
    got = fmt.decode(fields, torch.float32)
    for b in range(3):
        want = reference_roundtrip(x[b], fmt.channel_bits, sink=True)
        torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [2, 4])
def test_an_engine_runs_it_calibrated(tiny_llm: Callable[..., LLM], bits: int) -> None:
    llm = tiny_llm(kv_cache_dtype=f"kivi{bits}_mix", kv_residual=0, kv_key_wide_channels=8, kv_exact_sink=True,
                   kv_group_size=8, kv_calibration_tokens=100)
    keys, values = llm.engine.pool.kv[0].formats
    assert isinstance(keys, MixedChannelFormat) and keys.channel_bits is not None
    assert keys.channel_bits.sum(-1).max().item() <= bits * keys.channel_bits.shape[-1] + 8
    out = llm.generate([list(range(1, 60))], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert len(out[0].token_ids) == 8
