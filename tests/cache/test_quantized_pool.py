"""Compressed pages: attention over them equals attention over the same values decoded densely,
and each block is stored as the residual window says (full precision inside, encoded outside;
a staged pool's step reads its own new tokens in full precision too)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.cache.block_manager import BlockManager
from kvserve.cache.formats import KVFormat, format_names, make_format
from kvserve.cache.formats.block_rope import BlockRope
from kvserve.cache.formats.kivi import ChannelFormat
from kvserve.cache.formats.unroped import UnropedChannelFormat
from kvserve.cache.quantized_pool import QuantizedKVPool, encode_blocks
from kvserve.cache.staging_slots import StagingPlan
from kvserve.attention import StepMetadata
from kvserve.attention.selector import BACKENDS
from tests.backend_cases import heavy_case

HEADS, KV_HEADS, DIM = 4, 2, 64  # GQA, 2 query heads per KV head


def formats_of(name: str, seed: int = 0, bs: int = 16, **kw: object) -> tuple[KVFormat, KVFormat]:
    """(keys, values) formats; wide KIVI key channels calibrated on random importances, keys turned
    back by RoPE (kivi2_mix_unrope) given the angles of a base-100 RoPE over blocks of `bs`."""
    k, v = make_format(name, "k", **kw), make_format(name, "v", **kw)  # type: ignore[arg-type]
    importance = torch.rand(KV_HEADS, DIM, generator=torch.Generator().manual_seed(seed))
    if isinstance(k, UnropedChannelFormat):
        angle = torch.arange(bs).float()[:, None] / 100.0 ** (torch.arange(0, DIM, 2).float() / DIM)
        k = k.calibrated(importance, BlockRope(angle.cos(), angle.sin()))
    elif isinstance(k, ChannelFormat) and k.wide:
        k = k.calibrated(importance)
    return k, v


def roundtrip(name: str, role: str, x: torch.Tensor, bs: int, exact_from: int | None,
              fmt_kw: dict[str, object] | None = None) -> torch.Tensor:
    """What the cache should hold for one sequence's K or V [L, H, D], worked independently of the
    pool. Without staging (exact_from None) every token is encoded on its own; with it, whole
    blocks before `exact_from` are encoded and everything after is kept exactly."""
    fmt = formats_of(name, bs=bs, **(fmt_kw or {}))["kv".index(role)]
    fmt.fields(KV_HEADS, DIM, bs)  # binds head_dim (sparse)
    if exact_from is None:
        return fmt.decode(fmt.encode(x), x.dtype)
    out = x.clone()
    full = exact_from // bs
    if full:
        blocks = x[:full * bs].unflatten(0, (full, bs))
        out[:full * bs] = fmt.decode(encode_blocks(fmt, blocks), x.dtype).flatten(0, 1)
    return out


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_len: int) -> torch.Tensor:
    """Dense causal SDPA of the last q_len queries over all keys, GQA by repeating KV heads."""
    ctx = k.shape[0]
    group = HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, 1).transpose(0, 1), v.repeat_interleave(group, 1).transpose(0, 1)
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)


class Driver:
    """A pool, a block manager and sequences of random K/V/Q, stepped like the model runner does."""

    def __init__(self, fmt: str, bs: int, residual: int, lens: list[int], seed: int = 0,
                 backend: str = "torch", **fmt_kw: object) -> None:
        g = torch.Generator().manual_seed(seed)
        self.bs, self.residual, self.fmt, self.fmt_kw = bs, residual, fmt, fmt_kw
        num_blocks = max(64, 1024 // bs)
        formats = formats_of(fmt, bs=bs, **fmt_kw)
        staging = QuantizedKVPool.staging_slots(4, bs, residual, [formats], sum(lens))
        self.bm = BlockManager(num_blocks, bs, enable_prefix_caching=False, staging_slots=staging, residual=residual)
        self.pool = QuantizedKVPool(num_blocks, bs, KV_HEADS, DIM, torch.float32, torch.device("cpu"), [formats],
                                    residual, staging)
        reason = BACKENDS[backend].unsupported(self.pool, torch.device("cpu"))
        if reason is not None:
            pytest.skip(f"{backend}: {reason}")
        self.backend = BACKENDS[backend](self.pool, HEADS)
        total = max(lens) + 60
        self.k = [torch.randn(total, KV_HEADS, DIM, generator=g) for _ in lens]
        self.v = [torch.randn(total, KV_HEADS, DIM, generator=g) for _ in lens]
        for k in self.k:  # keys carry outlier channels, as real ones do
            k[:, :, 3] *= 20
        self.q = [torch.randn(total, HEADS, DIM, generator=g) for _ in lens]
        self.len = [0] * len(lens)
        self.ids = [str(i) for i in range(len(lens))]
        for sid, n in zip(self.ids, lens):
            assert self.bm.allocate_prompt(sid, [1] * n) is not None
        self.step(lens)

    def step(self, new: list[int]) -> None:
        starts = list(self.len)
        ends = [s + n for s, n in zip(starts, new)]
        for sid, end in zip(self.ids, ends):
            assert self.bm.allocate(sid, end) is not None
        step = StepMetadata.build(new, ends, [self.bm.tables[s][:self.bm.blocks_for(e)]
                                              for s, e in zip(self.ids, ends)], self.bs, torch.device("cpu"),
                                  kv_plan=self.pool.write_plan(self.plan(starts, ends)))
        self.out = self.backend.forward(0, torch.cat([q[s:e] for q, s, e in zip(self.q, starts, ends)]),
                                        torch.cat([k[s:e] for k, s, e in zip(self.k, starts, ends)]),
                                        torch.cat([v[s:e] for v, s, e in zip(self.v, starts, ends)]),
                                        self.backend.prepare(step), DIM ** -0.5)
        self.len = ends
        self.new = new

    def plan(self, starts: list[int], ends: list[int]) -> StagingPlan | None:
        staging = self.bm.staging
        return None if staging is None else staging.plan(
            [(self.bm.tables[s], start, end) for s, start, end in zip(self.ids, starts, ends)], ())

    def expected(self) -> torch.Tensor:
        outs = []
        for i, (end, n) in enumerate(zip(self.len, self.new)):
            # A staged pool seals after attention: the step reads the window it started with
            # and its own tokens exactly.
            exact_from = max(end - n - self.residual, 0) if self.pool.staged else None
            k = roundtrip(self.fmt, "k", self.k[i][:end], self.bs, exact_from, self.fmt_kw)
            v = roundtrip(self.fmt, "v", self.v[i][:end], self.bs, exact_from, self.fmt_kw)
            outs.append(reference(self.q[i][end - n:end], k, v, n))
        return torch.cat(outs)


@pytest.mark.parametrize("backend,bs", [
    *((b, bs) for b in BACKENDS for bs in (1, 16)),
    *(heavy_case(b, 128, backend=b) for b in BACKENDS)])
@pytest.mark.parametrize("fmt", format_names())
def test_attention_over_compressed_pages_equals_dense_over_decoded(fmt: str, bs: int, backend: str) -> None:
    """Mixed prefill lengths (partial and full blocks), then decode steps across a block edge."""
    residual = 32 if fmt.startswith("kivi") else 0
    d = Driver(fmt, bs, residual, [bs + 5, 2 * bs + 3, 7], backend=backend)
    torch.testing.assert_close(d.out, d.expected(), atol=2e-4, rtol=1e-4)
    for _ in range(13):
        d.step([1, 1, 1])
        torch.testing.assert_close(d.out, d.expected(), atol=2e-4, rtol=1e-4)
    d.step([9, 1, 30])  # a mixed step: chunks and single tokens together
    torch.testing.assert_close(d.out, d.expected(), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("fmt", ["kivi2", "kivi4"])
def test_exact_sink_pages_equal_dense_over_decoded(fmt: str, backend: str) -> None:
    """Each block's first key read from its fp16 sink field, the rest from codes, by every backend
    that reads KIVI keys; a residual of 0 seals blocks as soon as a step has read them."""
    d = Driver(fmt, 16, 0, [16 + 5, 2 * 16 + 3, 7], backend=backend, exact_sink=True)
    for k, written in zip(d.k, d.len):  # later sinks far from the rest: a decoder that missed
        k[-(-written // 16) * 16::16] *= 30  # the field would show it
    for new in ([1, 1, 1], [9, 1, 30], [1, 1, 1]):
        d.step(new)
        torch.testing.assert_close(d.out, d.expected(), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("fmt, wide", [("kivi2", 16), ("kivi4", 16), ("kivi2", 40)])
def test_wide_key_channels_and_symmetric_values_equal_dense_over_decoded(fmt: str, wide: int, backend: str) -> None:
    """Keys with a third (fifth) bit plane on calibrated channels (40: more than the C++ kernel's
    one-word vector path holds), values without zero-points, exact sinks, on every backend."""
    d = Driver(fmt, 16, 0, [16 + 5, 2 * 16 + 3, 7], backend=backend, exact_sink=True, key_wide_channels=wide,
               symmetric_values=True, group_size=32)
    for new in ([1, 1, 1], [9, 1, 30], [1, 1, 1]):
        d.step(new)
        torch.testing.assert_close(d.out, d.expected(), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("name", ["kivi2_mix_unrope", "kivi2_vq"])
def test_unroped_keys_and_value_sinks_equal_dense_over_decoded(name: str, backend: str) -> None:
    """kivi2_mix_unrope and kivi2_vq calibrated, with their int8 sinks (their scales in the first token's own slots):
    the pool seals blocks and gathers them through block tables as the format encodes and decodes a
    sequence's blocks alone (the format's own accuracy: test_kivi_unrope.py); later sinks far from
    the rest, so a pool path that lost a sink's scale beside its codes would show it."""
    d = Driver(name, 16, 0, [16 + 5, 2 * 16 + 3, 7], backend=backend, exact_sink=True,
               key_wide_channels=8, symmetric_values=True, group_size=32)
    for k, v, written in zip(d.k, d.v, d.len):
        k[-(-written // 16) * 16::16] *= 30
        v[-(-written // 16) * 16::16] *= 30
    for new in ([1, 1, 1], [9, 1, 30], [1, 1, 1]):
        d.step(new)
        torch.testing.assert_close(d.out, d.expected(), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("residual", [0, 16, 40])
def test_residual_window_stays_exact_and_is_sealed_behind(residual: int, backend: str) -> None:
    d = Driver("int4", 16, residual, [50], backend=backend)
    for _ in range(30):
        d.step([1])
        torch.testing.assert_close(d.out, d.expected(), atol=2e-4, rtol=1e-4)
    # Only blocks touching the window (and none beyond it) hold staging slots.
    end = d.len[0]
    table = d.bm.tables["0"]
    held = {} if d.bm.staging is None else d.bm.staging.stage_of
    staged = [i for i, b in enumerate(table) if b in held]
    assert staged == list(range(max(end - residual, 0) // 16, -(-end // 16)))


def test_compression_is_real() -> None:
    """Not a test that cannot fail: int4 output differs from exact attention by a real margin."""
    d = Driver("int4", 16, 0, [64])
    exact = torch.cat([reference(d.q[0][:64], d.k[0][:64], d.v[0][:64], 64)])
    assert (d.out - exact).abs().max() > 1e-3


def test_freed_blocks_return_their_staging_slots() -> None:
    d = Driver("kivi2", 16, 32, [40, 20])
    staging = d.bm.staging
    assert staging.stage_of
    for sid in d.ids:
        d.bm.free(sid)
    d.ids, d.len, d.k, d.v, d.q = d.ids[:0], [], [], [], []
    d.plan([], [])
    assert not staging.stage_of
    assert staging.num_free == staging.num_slots


def test_bytes_per_block_follow_the_formats() -> None:
    k, v = make_format("kivi2", "k"), make_format("kivi2", "v")
    # Hand-worked for 2 layers, 16 tokens, 2 heads, D=64: keys 16 B codes/token-head + per block
    # 2*64*2 B of scales/zeros per head; values 16 B codes + 2 groups * 4 B per token-head.
    keys = 2 * (16 * 16 + 64 * 2 * 2)
    values = 2 * 16 * (16 + 2 * 4)
    assert QuantizedKVPool.bytes_per_block(16, 2, 64, [(k, v)] * 2) == 2 * (keys + values)


def test_reused_block_drops_the_stale_staging_slot() -> None:
    """A staged block freed and handed to a new sequence before the next plan: the new owner's
    tokens must be read, not the old owner's full-precision copy."""
    d = Driver("kivi4", 16, 32, [40])
    d.bm.free("0")
    k, v, q = d.k[0], d.v[0], d.q[0]
    d.ids, d.len = ["1"], [0]
    d.k, d.v, d.q = [v.clone()], [k.clone()], [q.flip(0)]
    assert d.bm.allocate_prompt("1", [1] * 60) is not None
    d.step([60])
    torch.testing.assert_close(d.out, d.expected(), atol=2e-4, rtol=1e-4)
    assert len(set(d.bm.staging.stage_of.values())) == len(d.bm.staging.stage_of)
