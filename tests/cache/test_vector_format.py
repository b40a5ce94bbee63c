"""kivi2_vq's values (cache/formats/vector.py): the trainer finds the centroids worked by hand for a
Gaussian; the shipped codebook leaves less error than the best scalar codes at its rate (Max's
tables); each piece decodes to its nearest codebook point, found by brute force, times the
least-squares scale; codes past 255 survive their bit plane; the bytes are as the format says (its
value sinks: test_kivi_unrope.py); the engine runs it with kivi2_mix_unrope's keys."""
from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cache.formats import make_format
from kvserve.cache.formats.unroped import SinkValueFormat, UnropedChannelFormat
from kvserve.cache.formats.vector import CODEBOOK_SHAPE, VectorFormat, load_codebook, train_codebook

# Lloyd-Max quantizers of a unit Gaussian (J. Max, 1960): mean squared error at 2 and 3 bits.
MAX_2BIT, MAX_3BIT = 0.1175, 0.03454


def gaussian(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_two_points_on_a_line_settle_at_the_half_normals_means() -> None:
    book = train_codebook(2, 1, samples=100_000, iterations=20, seed=0).flatten().sort().values
    torch.testing.assert_close(book, torch.tensor([-1.0, 1.0]) * math.sqrt(2 / math.pi), atol=0.01, rtol=0)


def test_the_shipped_codebook_beats_scalar_codes_at_its_rate() -> None:
    """9 bits over 4 values: the best scalar split is 2, 2, 2 and 3 bits."""
    book = load_codebook()
    assert book.shape == CODEBOOK_SHAPE and torch.isfinite(book).all()
    x = gaussian(100_000, 4, seed=1)
    error = (x[:, None] - book[None]).square().sum(-1).amin(-1).mean() / 4
    assert error < (3 * MAX_2BIT + MAX_3BIT) / 4 * 0.76  # measured 0.070 against 0.097


@pytest.mark.parametrize("head_dim", [64, 80])  # 80: 20 pieces, a bit plane of 3 bytes with 4 spare bits
def test_pieces_decode_to_their_nearest_point_times_the_least_squares_scale(head_dim: int) -> None:
    fmt = VectorFormat("vq", load_codebook())
    x = gaussian(5, 3, head_dim, seed=2) * torch.tensor([0.01, 1.0, 300.0])[:, None]
    fields = fmt.encode(x)
    assert {name: t.shape[-1] for name, t in fields.items()} == {"codes": head_dim // 4,
                                                                  "high": math.ceil(head_dim / 32), "scale": 1}
    got = fmt.decode(fields, torch.float32)
    book = load_codebook()
    unit = (x / x.square().mean(-1, keepdim=True).sqrt()).unflatten(-1, (-1, 4))
    nearest = book[torch.cdist(unit.reshape(-1, 4), book).argmin(-1)].view(unit.shape).flatten(-2)
    scale = ((x * nearest).sum(-1, keepdim=True) / nearest.square().sum(-1, keepdim=True)).half().float()
    torch.testing.assert_close(got, nearest * scale, atol=1e-5, rtol=1e-5)
    relative = (got - x).square().sum(-1) / x.square().sum(-1)
    assert relative.mean() < (3 * MAX_2BIT + MAX_3BIT) / 4  # measured about 0.07


def test_codes_past_255_keep_their_ninth_bit() -> None:
    """Tokens built from codebook points 256-511 decode to exactly those points."""
    book = load_codebook()
    fmt = VectorFormat("vq", book)
    index = torch.arange(256, 512).view(16, 16)  # 16 tokens of 16 pieces, one head
    x = book[index].flatten(-2)[:, None]
    fields = fmt.encode(x)
    assert (fields["high"] != 0).all()
    got = fmt.decode(fields, torch.float32)
    torch.testing.assert_close(got / got.norm(dim=-1, keepdim=True), x / x.norm(dim=-1, keepdim=True),
                               atol=1e-6, rtol=0)


def test_tokens_near_fp16s_limit_decode_finite_in_fp16_and_a_non_finite_one_as_nan() -> None:
    """Uncapped, the fitted scale times a far point reaches 1.3 x a token's largest entry: inf in an
    fp16 pool for tokens inside fp16's range."""
    fmt = VectorFormat("vq", load_codebook())
    x = gaussian(2000, 2, 64, seed=5)
    x = x / x.abs().amax(-1, keepdim=True) * 60000
    x[0, 0] = -60000.0
    x[1, 1, 3] = math.inf
    got = fmt.decode(fmt.encode(x), torch.float16)
    assert got[1, 1].isnan().all()
    got[1, 1] = 0
    assert got.isfinite().all()


def test_it_costs_kivi2_mix_unropes_bytes_with_16_wide_key_channels_fewer() -> None:
    """Worked by hand, per head and token, head_dim 64: values 16 codes + 2 bytes of ninth bits + an
    fp16 scale = 20 bytes, where 2-bit groups of 64 are 16 + 2; 16 wide key channels are 2 bytes."""
    heads, dim, block = 3, 64, 128
    vq = [make_format("kivi2_vq", role, exact_sink=True, key_wide_channels=8) for role in "kv"]
    unrope = [make_format("kivi2_mix_unrope", role, exact_sink=True, key_wide_channels=24, group_size=64,
                          symmetric_values=True) for role in "kv"]
    assert isinstance(vq[0], UnropedChannelFormat) and isinstance(vq[1], SinkValueFormat)
    assert vq[1].bytes_per_token(heads, dim, block) == heads * (20 + dim / block)  # + the int8 sink
    assert vq[0].bytes_per_token(heads, dim, block) == unrope[0].bytes_per_token(heads, dim, block) - heads * 2
    total = sum(f.bytes_per_token(heads, dim, block) for f in vq)
    assert total == sum(f.bytes_per_token(heads, dim, block) for f in unrope)
    assert 30 * total == 3600  # SmolLM2's 30 layers: 2.5 bits a value
    assert isinstance(make_format("kivi2_vq", "v"), VectorFormat)  # no sinks asked: no sink field


def test_an_engine_runs_it_with_unroped_keys_and_vector_values(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm(kv_cache_dtype="kivi2_vq", kv_residual=0, kv_key_wide_channels=8, kv_exact_sink=True,
                   kv_calibration_tokens=100)
    for kv in llm.engine.pool.kv:
        keys, values = kv.formats
        assert isinstance(keys, UnropedChannelFormat) and keys.rope is not None
        assert isinstance(values, SinkValueFormat) and isinstance(values.codes, VectorFormat)
    out = llm.generate([list(range(1, 60))], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert len(out[0].token_ids) == 8
