"""KIVI keys with bits per channel (`kivi2_mix`, MixedChannelFormat): the allocation spends at most
kivi2's bits (2 a channel plus the wide channels), equal within RoPE pairs, more where importance
is, and minimises the modelled error (checked against every allocation of a small head); pages
cost what kivi2's with the same wide channels cost; decoding matches a per-channel quantizer
written out here; and an engine runs it calibrated."""
from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from kvserve import LLM, SamplingParams
from kvserve.cache.formats import make_format
from kvserve.cache.formats.kivi import MixedChannelFormat, allocate_bits


def modelled_cost(importance: torch.Tensor, bits: torch.Tensor) -> float:
    f = torch.where(bits == 0, 1.0, 1.0 / (2.0 ** bits - 1).clamp_min(1) ** 2)
    return (importance * f).sum().item()


def test_allocation_keeps_the_budget_and_pairs_and_is_optimal_on_a_small_head() -> None:
    g = torch.Generator().manual_seed(0)
    importance = torch.rand(2, 16, generator=g) ** 4  # a few channels hold most of it
    total = 2 * 16 + 8
    bits = allocate_bits(importance, total)
    assert (bits.sum(-1) <= total).all()
    assert torch.equal(bits[:, :8], bits[:, 8:])  # RoPE pairs share their bits
    assert set(bits.unique().tolist()) <= {0, 2, 3, 4}
    pairs = importance[:, :8] + importance[:, 8:]
    for h in range(2):  # every allocation of 8 pairs over {0, 2, 3, 4} within the budget
        norm = pairs[h] / pairs[h].sum()
        best = min(modelled_cost(norm, torch.tensor(c, dtype=torch.float32))
                   for c in itertools.product((0, 2, 3, 4), repeat=8) if 2 * sum(c) <= total)
        assert modelled_cost(norm, bits[h, :8].float()) <= best * 1.02


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


def test_decode_matches_a_per_channel_quantizer_and_kivi2s_price() -> None:
    g = torch.Generator().manual_seed(1)
    heads, dim, block = 2, 16, 32
    x = torch.randn(3, block, heads, dim, generator=g) * torch.linspace(0.5, 4, dim)
    importance = torch.rand(heads, dim, generator=g) ** 3
    fmt = MixedChannelFormat("kivi2_mix", exact_sink=True, wide=8).calibrated(importance)
    kivi2 = make_format("kivi2", "k", exact_sink=True, key_wide_channels=8)
    assert fmt.bytes_per_token(heads, dim, block) == kivi2.bytes_per_token(heads, dim, block)
    fields = fmt.encode(x)
    assert {k: tuple(v.shape[1:]) for k, v in fields.items()} == {k: s for k, (s, _) in
                                                                   fmt.fields(heads, dim, block).items()}
    got = fmt.decode(fields, torch.float32)
    for b in range(3):
        want = reference_roundtrip(x[b], fmt.channel_bits, sink=True)
        torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-5)


def test_an_engine_runs_it_calibrated(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm(kv_cache_dtype="kivi2_mix", kv_residual=0, kv_key_wide_channels=8, kv_exact_sink=True,
                   kv_group_size=8, kv_calibration_tokens=100)
    keys, values = llm.engine.pool.kv[0].formats
    assert isinstance(keys, MixedChannelFormat) and keys.channel_bits is not None
    assert keys.channel_bits.sum(-1).max().item() <= 2 * keys.channel_bits.shape[-1] + 8
    out = llm.generate([list(range(1, 60))], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert len(out[0].token_ids) == 8
