"""kivi2_mix_unrope (cache/formats/unroped.py, block_rope.py): RoPE undone within a block agrees with
HF transformers' own RoPE; keys that hardly move before RoPE lose far less turned back than coded as
RoPE left them, and otherwise decode as kivi2_mix's codes would on the turned keys; the int8 sinks of
keys and values hold their first token to int8's step and cost, with kivi2_mix's fp16 key sink, the
same bytes; the engine calibrates it per layer with the layer's angles; a rotation of the keys is
refused naming its field."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvserve import LLM, SamplingParams
from kvserve.cache.formats import make_format
from kvserve.cache.formats.block_rope import BlockRope
from kvserve.cache.formats.grouped import GroupFormat
from kvserve.cache.formats.kivi import MixedChannelFormat
from kvserve.cache.formats.unroped import SinkValueFormat, UnropedChannelFormat
from kvserve.cache.formats.vector import VectorFormat, load_codebook
from kvserve.config import EngineConfig

BLOCK, HEADS, DIM = 32, 2, 16


def block_rope(theta: float = 10000.0) -> BlockRope:
    angle = torch.arange(BLOCK).float()[:, None] / theta ** (torch.arange(0, DIM, 2).float() / DIM)
    return BlockRope(angle.cos(), angle.sin())


def test_block_rope_is_hf_rope_at_the_block_offsets_and_undoes_it() -> None:
    rope = block_rope()
    x = torch.randn(3, BLOCK, HEADS, DIM, generator=torch.Generator().manual_seed(0))
    cos, sin = torch.cat([rope.cos, rope.cos], -1), torch.cat([rope.sin, rope.sin], -1)
    # HF: [batch, heads, seq, dim] with cos/sin [batch, seq, dim].
    hf, _ = apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos[None], sin[None])
    torch.testing.assert_close(rope.rotate(x), hf.transpose(1, 2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rope.unrotate(rope.rotate(x)), x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rope.unrotate(x[:, :5]), rope.unrotate(x)[:, :5])  # a partial block: its offsets
    with pytest.raises(ValueError, match="block of 33 tokens"):
        rope.unrotate(torch.zeros(BLOCK + 1, HEADS, DIM))


def still_keys(seed: int) -> torch.Tensor:
    """Keys that hardly move before RoPE (a per-block content plus a little noise), as RoPE leaves them."""
    g = torch.Generator().manual_seed(seed)
    before = 4 * torch.randn(3, 1, HEADS, DIM, generator=g) + 0.2 * torch.randn(3, BLOCK, HEADS, DIM, generator=g)
    return block_rope().rotate(before)


@pytest.mark.parametrize("sink", [False, True])
def test_keys_turned_back_decode_as_kivi2_mix_on_the_turned_keys(sink: bool) -> None:
    rope = block_rope()
    importance = torch.rand(HEADS, DIM, generator=torch.Generator().manual_seed(1)) ** 2
    unroped = UnropedChannelFormat("u", 2, sink, 8).calibrated(importance, rope)
    mixed = MixedChannelFormat("m", 2, sink, 8).calibrated(importance)
    assert torch.equal(unroped.channel_bits, mixed.channel_bits)
    x = still_keys(2)
    got = unroped.decode(unroped.encode(x), torch.float32)
    turned = rope.unrotate(x)
    want = rope.rotate(mixed.decode(mixed.encode(turned), torch.float32))
    torch.testing.assert_close(got[:, 1:], want[:, 1:], atol=1e-4, rtol=1e-4)
    if sink:  # int8 codes: within half a step of amax / 127 of the first key, per head
        step = x[:, 0].abs().amax(-1, keepdim=True) / 127
        assert ((got[:, 0] - x[:, 0]).abs() <= step * 0.51 + 1e-6).all()
    plain = mixed.decode(mixed.encode(x), torch.float32)
    assert (got - x).square().mean() < 0.05 * (plain - x).square().mean()  # measured: 0.020


def test_an_uncalibrated_format_codes_keys_as_they_come_and_calibration_needs_the_angles() -> None:
    fmt = make_format("kivi2_mix_unrope", "k")
    x = still_keys(3)
    plain = make_format("kivi2_mix", "k")
    torch.testing.assert_close(fmt.decode(fmt.encode(x), torch.float32), plain.decode(plain.encode(x), torch.float32))
    with pytest.raises(ValueError, match="RoPE angles"):
        fmt.calibrated(torch.ones(HEADS, DIM))


@pytest.mark.parametrize("codes", [GroupFormat("v", 2, 8, symmetric=True), VectorFormat("v", load_codebook())],
                         ids=["groups", "vectors"])
def test_value_sinks_keep_the_first_value_and_the_rest_decode_as_their_codes(
        codes: GroupFormat | VectorFormat) -> None:
    fmt = SinkValueFormat(codes)
    x = torch.randn(3, BLOCK, HEADS, DIM, generator=torch.Generator().manual_seed(4))
    got = fmt.decode(fmt.encode(x), torch.float32)
    torch.testing.assert_close(got[:, 1:], codes.decode(codes.encode(x), torch.float32)[:, 1:])
    step = x[:, 0].abs().amax(-1, keepdim=True) / 127
    assert ((got[:, 0] - x[:, 0]).abs() <= step * 0.51 + 1e-6).all()


def test_both_sinks_cost_what_kivi2_mixs_key_sink_costs() -> None:
    """Worked by hand: a block's int8 sink is DIM bytes a head where kivi's fp16 one is 2 DIM, and the
    scales ride in the first token's own slots; so keys save DIM / BLOCK bytes a head and values add them."""
    options = {"exact_sink": True, "key_wide_channels": 8, "symmetric_values": True, "group_size": 8}
    k, v = (make_format("kivi2_mix_unrope", role, **options) for role in "kv")
    mk, mv = (make_format("kivi2_mix", role, **options) for role in "kv")
    assert isinstance(k, UnropedChannelFormat) and isinstance(v, SinkValueFormat)
    assert k.bytes_per_token(HEADS, DIM, BLOCK) == mk.bytes_per_token(HEADS, DIM, BLOCK) - HEADS * DIM / BLOCK
    assert v.bytes_per_token(HEADS, DIM, BLOCK) == mv.bytes_per_token(HEADS, DIM, BLOCK) + HEADS * DIM / BLOCK
    without = make_format("kivi2_mix_unrope", "v", symmetric_values=True, group_size=8)
    assert isinstance(without, GroupFormat)  # no sinks asked: kivi2_mix's values


def test_an_engine_calibrates_it_with_each_layers_angles(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm(kv_cache_dtype="kivi2_mix_unrope", kv_residual=0, kv_key_wide_channels=8, kv_exact_sink=True,
                   kv_group_size=8, kv_calibration_tokens=100)
    model = llm.engine.model
    cos, _ = model.model.rotary.tables(local=False)
    for kv in llm.engine.pool.kv:
        keys, values = kv.formats
        assert isinstance(keys, UnropedChannelFormat) and keys.rope is not None
        assert isinstance(values, SinkValueFormat)
        torch.testing.assert_close(keys.rope.cos, cos[:llm.engine.config.cache.block_size].float().cpu())
    out = llm.generate([list(range(1, 60))], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert len(out[0].token_ids) == 8


def test_rotated_keys_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="kv_rotate_keys"):
        EngineConfig.of(kv_cache_dtype="kivi2_mix_unrope", kv_rotation="hadamard")
    EngineConfig.of(kv_cache_dtype="kivi2_mix_unrope", kv_rotation="hadamard", kv_rotate_keys=False)
