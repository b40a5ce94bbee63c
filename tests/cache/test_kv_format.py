"""KV-cache formats: error bounds against the stored scales, storage cost, per-token scatter."""
from __future__ import annotations

import math

import pytest
import torch

from kvserve.cache.formats import KVFormat, format_names, make_format
from kvserve.cache.formats.codes import MIN_SCALE
from kvserve.cache.formats.vector import VectorFormat

TOKENS = (37, 3, 64)         # [N, H, D]
BLOCKS = (5, 16, 2, 64)      # [B, bs, H, D]
PLANTED = [3, 17, 40]        # channels holding outliers, as keys do
ROLES = ("k", "v")
FORMAT_NAMES = format_names()  # the built-ins: no test registers one at collection
F16_EPS = 2.0 ** -11         # fp16 rounding, relative
F16_TINY = 2.0 ** -25        # half fp16's smallest subnormal


def kv_data(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Gaussian K/V whose PLANTED channels are outliers of magnitude 50..100."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    planted = x[..., PLANTED]
    sign = torch.randint(0, 2, planted.shape, generator=g) * 2 - 1
    x[..., PLANTED] = 50 * (1 + torch.rand(planted.shape, generator=g)) * sign
    return x.to(dtype)


def shape_for(fmt: KVFormat) -> tuple[int, ...]:
    return TOKENS if fmt.per_token else BLOCKS


def per_group(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A per-group field [..., D / g] spread to the channels it covers [..., D]."""
    return t.float().repeat_interleave(head_dim // t.shape[-1], -1)


def unpack_ref(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes in byte order, the first in the low bits (the layout a kernel would read)."""
    fields = [(packed >> (bits * j)) & (2 ** bits - 1) for j in range(8 // bits)]
    return torch.stack(fields, -1).flatten(-2).float()


def allowed_error(fmt: KVFormat, x: torch.Tensor, f: dict[str, torch.Tensor]) -> torch.Tensor:
    """The largest |decode - x| each entry may have, derived from the format and its stored fields."""
    x = x.float()
    d = x.shape[-1]
    fp16_rounding = F16_EPS * x.abs() + F16_TINY
    if fmt.name in ("bf16", "fp16", "fp32"):
        mantissa = {"bf16": 7, "fp16": 10, "fp32": 23}[fmt.name]
        return 2.0 ** -(mantissa + 1) * x.abs() + F16_TINY
    if fmt.name in ("int8", "int8_fit"):
        return f["scale"].float().unsqueeze(-1) / 2
    if fmt.name.startswith("fp8"):
        # Half an ulp: relative 2^-(mantissa+1) in the normal range, else half the smallest subnormal.
        mantissa, smallest_subnormal = {"fp8_e4m3": (3, 2.0 ** -9), "fp8_e4m3_fit": (3, 2.0 ** -9),
                                        "fp8_e5m2": (2, 2.0 ** -16)}[fmt.name]
        return 2.0 ** -(mantissa + 1) * x.abs() + smallest_subnormal / 2 * f["scale"].float().unsqueeze(-1)
    if isinstance(fmt, VectorFormat):
        # No bound per entry: the least-squares scale projects the token onto its points' direction,
        # so the error's norm is at most the token's (fp16 scale rounding aside); vector.py's own tests
        # hold each piece to its nearest point.
        return (x.norm(dim=-1, keepdim=True) * (1 + 2.0 ** -10)).expand_as(x)
    if not fmt.per_token:  # KIVI keys: one scale per (block, head, channel)
        return f["scale"].float().unsqueeze(-3) / 2
    bound = per_group(f["scale"], d) / 2
    if fmt.name == "outlier":
        exact = torch.zeros_like(x, dtype=torch.bool).scatter(-1, f["outlier_idx"].long(), True)
        bound = torch.where(exact, fp16_rounding, bound)
    return bound


def assert_within(err: torch.Tensor, bound: torch.Tensor, x: torch.Tensor) -> None:
    slack = 1e-6 * x.float().abs() + 1e-12  # fp32 arithmetic of decode itself
    excess = err - bound - slack
    assert excess.max() <= 0, f"error exceeds its bound by {excess.max().item():.3g}"


def round_trip(fmt: KVFormat, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    f = fmt.encode(x)
    return f, fmt.decode(f, torch.float32)


QUANTIZED = [(n, r) for n in FORMAT_NAMES if n != "sparse" for r in ROLES]


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,role", QUANTIZED)
def test_round_trip_error_within_bound(name: str, role: str, in_dtype: torch.dtype) -> None:
    fmt = make_format(name, role)
    x = kv_data(*shape_for(fmt), dtype=in_dtype)
    f, y = round_trip(fmt, x)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert_within((y - x.float()).abs(), allowed_error(fmt, x, f), x)


@pytest.mark.parametrize("name,role", [(n, r) for n in ("int4", "kivi2", "kivi4", "outlier")
                                       for r in ROLES if not (n.startswith("kivi") and r == "k")])
def test_group_codes_decode_as_code_times_scale_plus_zero(name: str, role: str) -> None:
    fmt = make_format(name, role)
    x = kv_data(*TOKENS)
    f, y = round_trip(fmt, x)
    bits = 8 * f["codes"].shape[-1] // x.shape[-1]
    codes = unpack_ref(f["codes"], bits)
    assert codes.max() <= 2 ** bits - 1
    ref = codes * per_group(f["scale"], x.shape[-1]) + per_group(f["zero"], x.shape[-1])
    if name == "outlier":
        ref = ref.scatter(-1, f["outlier_idx"].long(), f["outlier_val"].float())
    torch.testing.assert_close(y, ref, rtol=0, atol=0)


def test_int4_layout_by_hand() -> None:
    fmt = make_format("int4", "v", group_size=4)
    x = torch.tensor([0.0, 1, 2, 3, -1, -1, -1, -1]).view(1, 1, 8)
    f = fmt.encode(x)
    # Group 1: range 3 over 15 steps; fp16(0.2) = 0.19995 would put 3 at code 15.004, so the
    # stored scale is the next fp16 up, 0.20007; codes 0, 5, 10, 15 -> bytes 0x50, 0xFA.
    # Group 2 is constant: zero = -1, minimum scale, all codes 0.
    assert f["codes"].flatten().tolist() == [0x50, 0xFA, 0, 0]
    assert f["scale"].flatten().tolist() == [0.2000732421875, MIN_SCALE]
    assert f["zero"].flatten().tolist() == [0.0, -1.0]
    y = fmt.decode(f, torch.float32).flatten()
    step = 0.2000732421875
    assert y.tolist() == [0.0, 5 * step, 10 * step, 15 * step, -1, -1, -1, -1]


def test_int8_by_hand() -> None:
    fmt = make_format("int8", "k")
    f = fmt.encode(torch.tensor([1.27, -0.5, 0.0, 0.635]).view(1, 1, 4))
    # amax / 127 = 0.01, stored as fp16 0.0100021 (nearest is already above: no bump).
    assert f["scale"].item() == 0.01000213623046875
    assert f["codes"].flatten().tolist() == [127, -50, 0, 63]


def test_fp8_scale_rounds_up_so_the_max_stays_representable() -> None:
    fmt = make_format("fp8_e4m3", "k")
    f = fmt.encode(torch.tensor([1.0, -0.25]).view(1, 1, 2))
    # 1 / 448 to nearest fp16 is 0.0022316, which would map 1.0 to 448.1, past e4m3's max (NaN);
    # the stored scale is the next fp16 up, (1 + 147/1024) * 2^-9.
    assert f["scale"].item() == (1 + 147 / 1024) * 2.0 ** -9
    assert f["codes"].float().flatten().tolist() == [448.0, -112.0]


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_largest_entry_maps_to_the_code_max(name: str) -> None:
    fmt = make_format(name, "k")
    f = fmt.encode(kv_data(*TOKENS))
    code_max = 127 if name == "int8" else torch.finfo(f["codes"].dtype).max
    assert (f["codes"].float().abs().amax(-1) == code_max).all()


@pytest.mark.parametrize("name,role", [("int8", "k"), ("int4", "v"), ("kivi2", "v"), ("kivi4", "k"),
                                       ("kivi2", "k"), ("outlier", "k")])
@pytest.mark.parametrize("offset,spread", [(0.0, 1e-9), (1.0, 1e-6), (-37.3, 1e-3), (50.0, 0.01),
                                           (1000.0, 1.0), (-30000.0, 100.0)])
def test_bound_holds_for_offset_and_tiny_ranges(name: str, role: str, offset: float, spread: float) -> None:
    """Narrow ranges far from 0 are where fp16 rounding of the zero-point and scale would bite."""
    fmt = make_format(name, role)
    x = offset + spread * torch.randn(*shape_for(fmt), generator=torch.Generator().manual_seed(1))
    f, y = round_trip(fmt, x)
    assert_within((y - x).abs(), allowed_error(fmt, x, f), x)
    if "zero" not in f:
        return
    # The stored grid spans every entry that sets a range: zero <= x <= zero + qmax * scale.
    bits = 8 * f["codes"].shape[-1] // x.shape[-1]
    if fmt.per_token:
        scale, zero = per_group(f["scale"], x.shape[-1]), per_group(f["zero"], x.shape[-1])
    else:
        scale, zero = f["scale"].float().unsqueeze(-3), f["zero"].float().unsqueeze(-3)
    ranged = torch.ones_like(x, dtype=torch.bool)
    if "outlier_idx" in f:
        ranged = ranged.scatter(-1, f["outlier_idx"].long(), False)
    assert (zero <= x)[ranged].all()
    assert (zero + (2 ** bits - 1) * scale >= x - 1e-6 * x.abs())[ranged].all()


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp32"])
def test_plain_formats_store_the_dtype(name: str) -> None:
    fmt = make_format(name, "k")
    x = kv_data(*TOKENS)
    f, y = round_trip(fmt, x)
    assert list(f) == ["data"] and f["data"].dtype == {"bf16": torch.bfloat16, "fp16": torch.float16,
                                                       "fp32": torch.float32}[name]
    assert torch.equal(y, x.to(f["data"].dtype).float())


def test_outlier_keeps_planted_outliers_exactly_and_beats_int4() -> None:
    x = kv_data(*TOKENS)
    fmt = make_format("outlier", "k")
    f, y = round_trip(fmt, x)
    stored = torch.zeros_like(x, dtype=torch.bool).scatter(-1, f["outlier_idx"].long(), True)
    assert stored[..., PLANTED].all()
    assert torch.equal(y[..., PLANTED], x[..., PLANTED].half().float())
    # Without the outliers in their groups' ranges, the step is that of the Gaussian entries.
    rest = x.masked_fill(stored, math.nan).unflatten(-1, (-1, 32))
    rest_range = rest.nan_to_num(-math.inf).amax(-1) - rest.nan_to_num(math.inf).amin(-1)
    assert (f["scale"].float() <= rest_range / 15 * (1 + 2 ** -9) + 2 ** -10).all()
    int4_err = (make_format("int4", "k").decode(make_format("int4", "k").encode(x), torch.float32) - x).abs()
    assert (y - x).abs().mean() < int4_err.mean() / 5


def test_kivi_keys_isolate_outlier_channels() -> None:
    x = kv_data(*BLOCKS)
    normal = [c for c in range(x.shape[-1]) if c not in PLANTED]
    kivi = make_format("kivi4", "k")
    assert not kivi.per_token and make_format("kivi4", "v").per_token
    kivi_err = (kivi.decode(kivi.encode(x), torch.float32) - x).abs()[..., normal]
    tokens = x.flatten(0, 1)
    int4 = make_format("int4", "k")
    int4_err = (int4.decode(int4.encode(tokens), torch.float32) - tokens).abs()[..., normal]
    assert kivi_err.mean() < int4_err.mean() / 5


@pytest.mark.parametrize("bits", [2, 4])
def test_exact_sink_keeps_each_blocks_first_key_out_of_the_ranges(bits: int) -> None:
    x = kv_data(*BLOCKS)
    x[:, 0] *= 40  # a first key far outside the rest, as an attention sink's is
    fmt = make_format(f"kivi{bits}", "k", exact_sink=True)
    f = fmt.encode(x)
    y = fmt.decode(f, torch.float32)
    torch.testing.assert_close(y[:, 0], x[:, 0].half().float(), rtol=0, atol=0)
    rest = x[:, 1:]
    # The ranges are the other tokens' own: zero at their minimum (rounded down to fp16), every
    # one of them within half a stored step.
    lo = rest.amin(1)
    assert (f["zero"].float() <= lo).all() and (lo - f["zero"].float() <= 2 * F16_EPS * lo.abs() + F16_TINY).all()
    assert ((y[:, 1:] - rest).abs() <= f["scale"].float()[:, None] / 2 * (1 + 1e-5)).all()
    plain = make_format(f"kivi{bits}", "k")
    assert (plain.decode(plain.encode(x), torch.float32)[:, 1:] - rest).abs().mean() > 4 * (y[:, 1:] - rest).abs().mean()
    # 16 more bits per channel and block.
    assert fmt.bytes_per_token(2, 64, 16) == plain.bytes_per_token(2, 64, 16) + 2 * 64 * 2 / 16


@pytest.mark.parametrize("threshold,capacity", [(0.5, 0.5), (1.0, 0.25), (0.0, 1.0), (2.0, 0.9)])
@pytest.mark.parametrize("planted", [True, False])
def test_sparse_keeps_exactly_the_large_entries(threshold: float, capacity: float, planted: bool) -> None:
    fmt = make_format("sparse", "k", sparse_threshold=threshold, sparse_capacity=capacity)
    x = kv_data(*TOKENS) if planted else torch.randn(*TOKENS, generator=torch.Generator().manual_seed(2))
    f, y = round_trip(fmt, x)
    d = x.shape[-1]
    rank = x.abs().argsort(-1, descending=True).argsort(-1)  # 0 = largest magnitude
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    keep = (rank < math.ceil(capacity * d)) & (x.abs() >= threshold * rms)
    assert torch.equal(y[keep], x[keep].half().float())
    assert (y[~keep] == 0).all()
    assert fmt.kept_fraction(f) == keep.sum().item() / x.numel()


def test_sparse_capacity_and_threshold_both_bind() -> None:
    """Guards the test above: its data exercises both reasons to drop an entry."""
    fmt = make_format("sparse", "k")
    plain, planted = torch.randn(*TOKENS, generator=torch.Generator().manual_seed(2)), kv_data(*TOKENS)
    # Gaussian: ~62% of entries clear 0.5 rms, more than the 50% capacity.
    assert fmt.kept_fraction(fmt.encode(plain)) == 0.5
    # Outlier channels raise the rms so that only they clear the threshold.
    assert fmt.kept_fraction(fmt.encode(planted)) == len(PLANTED) / TOKENS[-1]


H, D, BS = 3, 64, 16


def expected_bytes(name: str, role: str, h: int, d: int, bs: int, g: int, outliers: int,
                   capacity: float) -> float:
    """Worked by hand from each format's description; fp16 scales and zero-points are 2 bytes."""
    per_head = {
        "bf16": 2 * d, "fp16": 2 * d, "fp32": 4 * d,
        "fp8_e4m3": d + 2, "fp8_e5m2": d + 2, "int8": d + 2,     # codes + one scale
        "fp8_e4m3_fit": d + 2, "int8_fit": d + 2,               # the same, the scale fitted
        "int4": d / 2 + (d / g) * (2 + 2),                       # nibbles + scale, zero per group
        "outlier": d / 2 + (d / g) * (2 + 2) + outliers * (2 + 1),  # + fp16 value, uint8 index
        "sparse": math.ceil(capacity * d) * (2 + 1),
    }
    for bits in (2, 4):  # keys: scale + zero per channel per block; values: per group, as int4
        per_head[f"kivi{bits}"] = (d * bits / 8 + 2 * d * 2 / bs if role == "k"
                                   else d * bits / 8 + (d / g) * (2 + 2))
    per_head["kivi2_mix"] = per_head["kivi2"]  # kivi's bits, spread over channels by calibration
    per_head["kivi4_mix"] = per_head["kivi4"]
    per_head["kivi2_mix_unrope"] = per_head["kivi2"]  # its sinks only with kv_exact_sink
    # keys kivi2's; values a 9-bit code per 4 channels (8 bits + a bit plane) and an fp16 scale
    per_head["kivi2_vq"] = per_head["kivi2"] if role == "k" else d / 4 + math.ceil(d / 32) + 2
    return h * per_head[name]


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_bytes_per_token(name: str, role: str) -> None:
    default = make_format(name, role)
    assert default.bytes_per_token(H, D, BS) == expected_bytes(name, role, H, D, BS, 32, 4, 0.5)
    fmt = make_format(name, role, group_size=16, outliers=8, sparse_capacity=0.3)
    assert fmt.bytes_per_token(1, 80, 8) == expected_bytes(name, role, 1, 80, 8, 16, 8, 0.3)


def test_bytes_per_token_spot_values() -> None:
    assert make_format("int4", "k").bytes_per_token(3, 64, 16) == 3 * (64 / 2 + 2 * (2 + 2)) == 120
    assert make_format("int8", "v").bytes_per_token(3, 64, 16) == 3 * (64 + 2)
    assert make_format("kivi2", "k").bytes_per_token(3, 64, 16) == 3 * (64 * 2 / 8 + 2 * 64 * 2 / 16) == 96


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_encode_matches_fields(name: str, role: str) -> None:
    fmt = make_format(name, role)
    x = kv_data(*shape_for(fmt))
    spec = fmt.fields(x.shape[-2], x.shape[-1], BLOCKS[1])
    f = fmt.encode(x)
    assert f.keys() == spec.keys()
    for key, (shape, dtype) in spec.items():
        if fmt.per_token:
            assert shape[:2] == (BLOCKS[1], x.shape[-2])
            assert f[key].shape == (x.shape[0], *shape[1:])
        else:
            assert f[key].shape == (x.shape[0], *shape)
        assert f[key].dtype == dtype


PER_TOKEN = [(n, r) for n in FORMAT_NAMES for r in ROLES if make_format(n, r).per_token]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("name,role", PER_TOKEN)
def test_per_token_encoding_commutes_with_slicing(name: str, role: str) -> None:
    fmt = make_format(name, role)
    x = kv_data(*TOKENS)
    subset = torch.tensor([5, 0, 36, 17, 17])
    whole, part = fmt.encode(x), fmt.encode(x[subset])
    assert all(same_bits(whole[k][subset], part[k]) for k in whole)
    assert torch.equal(fmt.decode({k: v[subset] for k, v in whole.items()}, torch.float32),
                       fmt.decode(part, torch.float32))


@pytest.mark.parametrize("name,role", PER_TOKEN)
def test_tokens_scattered_into_block_storage_decode_per_block(name: str, role: str) -> None:
    """What the pool does: write each token into its slot, later decode whole blocks."""
    fmt = make_format(name, role)
    num_blocks = 4
    x = kv_data(*TOKENS)
    spec = fmt.fields(x.shape[1], x.shape[2], BS)
    pool = {k: torch.zeros((num_blocks, *shape), dtype=dtype) for k, (shape, dtype) in spec.items()}
    slots = torch.randperm(num_blocks * BS, generator=torch.Generator().manual_seed(3))[:x.shape[0]]
    encoded = fmt.encode(x)
    for key, (shape, _) in spec.items():
        pool[key].view(-1, *shape[1:])[slots] = encoded[key]
    blocks = fmt.decode(pool, torch.float32)
    assert blocks.shape == (num_blocks, BS, *x.shape[1:])
    assert torch.equal(blocks.view(-1, *x.shape[1:])[slots], fmt.decode(encoded, torch.float32))


def test_block_format_encodes_blocks_independently() -> None:
    fmt = make_format("kivi2", "k")
    x = kv_data(*BLOCKS)
    whole, one = fmt.encode(x), fmt.encode(x[2:3])
    assert all(torch.equal(whole[k][2:3], one[k]) for k in whole)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name,role", [(n, r) for n in FORMAT_NAMES for r in ROLES])
def test_decode_returns_requested_dtype(name: str, role: str, dtype: torch.dtype) -> None:
    fmt = make_format(name, role)
    f = fmt.encode(kv_data(*shape_for(fmt)))
    y = fmt.decode(f, dtype)
    assert y.dtype == dtype
    assert torch.equal(y, fmt.decode(f, torch.float32).to(dtype))


@pytest.mark.parametrize("value", [0.0, 3.0, -1e-3, 1e-9, -60000.0])
@pytest.mark.parametrize("name,role", [(n, r) for n in FORMAT_NAMES for r in ROLES])
def test_constant_input_decodes_without_nan(name: str, role: str, value: float) -> None:
    fmt = make_format(name, role)
    x = torch.full(shape_for(fmt), value)
    f, y = round_trip(fmt, x)
    assert all(not t.float().isnan().any() for t in f.values())
    assert y.isfinite().all()
    if value == 0:
        assert (y == 0).all()
    elif name != "sparse":  # sparse drops half of a constant vector by design (capacity 0.5)
        assert_within((y - x).abs(), allowed_error(fmt, x, f), x)
        if not isinstance(fmt, VectorFormat):  # a codebook has no point in every direction
            assert ((y - x).abs() <= 2 ** -4 * abs(value) + MIN_SCALE).all()


@pytest.mark.parametrize("kwargs,field", [
    ({"name": "int3"}, "kv_cache_dtype"),
    ({"name": "INT8"}, "kv_cache_dtype"),
    ({"role": "q"}, "role"),
    ({"group_size": 3}, "kv_group_size"),
    ({"group_size": 256}, "kv_group_size"),
    ({"group_size": 32.0}, "kv_group_size"),
    ({"outliers": 0}, "kv_outliers"),
    ({"sparse_threshold": -0.1}, "kv_sparse_threshold"),
    ({"sparse_capacity": 0.0}, "kv_sparse_capacity"),
    ({"sparse_capacity": 1.5}, "kv_sparse_capacity"),
    ({"key_wide_channels": 4}, "kv_key_wide_channels"),
    ({"key_wide_channels": -8}, "kv_key_wide_channels"),
])
def test_make_format_rejects_bad_settings(kwargs: dict, field: str) -> None:
    args = {"name": "int4", "role": "k", **kwargs}
    with pytest.raises(ValueError, match=field):
        make_format(args.pop("name"), args.pop("role"), **args)


def test_unknown_format_message_lists_the_choices() -> None:
    with pytest.raises(ValueError, match='unknown format "int3"; choose one of bf16, .*sparse'):
        make_format("int3", "k")


@pytest.mark.parametrize("name,kwargs,head_dim,field", [
    ("int4", {"group_size": 48}, 64, "kv_group_size"),
    ("kivi2", {"group_size": 96}, 64, "kv_group_size"),
    ("outlier", {"outliers": 65}, 64, "kv_outliers"),
    ("sparse", {}, 512, "head_dim"),
    ("kivi2", {"group_size": 6}, 66, "head_dim"),
])
def test_fields_reject_settings_that_do_not_fit_head_dim(name: str, kwargs: dict, head_dim: int,
                                                          field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make_format(name, "v", **kwargs).fields(2, head_dim, BS)
    with pytest.raises(ValueError, match="kv_key_wide_channels"):
        make_format("kivi2", "k", key_wide_channels=72).fields(2, 64, BS)


@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("bits", [2, 4])
def test_wide_key_channels_get_one_more_bit(bits: int, sink: bool) -> None:
    """The calibrated channels are the top RoPE pairs (d, d + D/2) by summed importance; their
    step is their range over 2^(bits+1) - 1 levels, the others' over 2^bits - 1; a bit plane of
    `wide` bits per token and head is all they cost."""
    x = kv_data(*BLOCKS)
    importance = torch.rand(2, 64, generator=torch.Generator().manual_seed(1))
    importance[0, [5, 37]] = 10.0  # pair 5 for head 0 (channel 37 = 5 + 32)
    importance[1, 40] = 30.0  # pair 8 for head 1, through its second half alone
    fmt = make_format(f"kivi{bits}", "k", exact_sink=sink, key_wide_channels=8)
    with pytest.raises(RuntimeError, match="calibrate"):
        fmt.encode(x)
    fmt = fmt.calibrated(importance)
    pair_sums = importance[:, :32] + importance[:, 32:]
    for head in range(2):
        top = pair_sums[head].topk(4).indices
        assert fmt.wide_channels[head].tolist() == sorted([*top.tolist(), *(top + 32).tolist()])
    assert 5 in fmt.wide_channels[0] and 37 in fmt.wide_channels[0] and 8 in fmt.wide_channels[1]
    f = fmt.encode(x)
    y = fmt.decode(f, torch.float32)
    body, got = (x[:, 1:], y[:, 1:]) if sink else (x, y)
    ranges = body.amax(1) - body.amin(1)  # [B, H, D]
    wide = torch.zeros(2, 64, dtype=torch.bool).scatter(1, fmt.wide_channels, True)
    levels = torch.where(wide, 2 ** (bits + 1) - 1, 2 ** bits - 1)
    step = f["scale"].float()
    assert (step >= ranges / levels).all() and (step <= ranges / levels * (1 + 4 * F16_EPS) + MIN_SCALE).all()
    assert ((got - body).abs() <= step[:, None] / 2 * (1 + 1e-5)).all()
    plain = make_format(f"kivi{bits}", "k", exact_sink=sink)
    assert fmt.bytes_per_token(2, 64, 16) == plain.bytes_per_token(2, 64, 16) + 2 * 8 / 8


def test_symmetric_values_use_every_level_and_no_zero_point() -> None:
    """2-bit midrise codes: the four levels +-0.5 and +-1.5 steps, each group's step fitted (here
    the absmax one, on which both groups lie exactly), every entry within half a step unless it lies beyond
    the outermost level, where it saturates (test_formats_fit.py checks the fit)."""
    fmt = make_format("kivi2", "v", group_size=4, symmetric_values=True)
    x = torch.tensor([[[-1.5, -0.5, 0.5, 1.5, 3.0, -1.0, 1.0, -3.0]]])  # [1 token, 1 head, 8]: on the grids
    f = fmt.encode(x)
    assert set(f) == {"codes", "scale"}
    torch.testing.assert_close(f["scale"].float(), torch.tensor([[[1.0, 2.0]]]))
    torch.testing.assert_close(fmt.decode(f, torch.float32), x)
    assert torch.equal(f["codes"], torch.tensor([[[0b11100100, 0b00100111]]], dtype=torch.uint8))
    y = kv_data(*TOKENS)
    g = make_format("kivi2", "v", group_size=32, symmetric_values=True)
    fy = g.encode(y)
    step = fy["scale"].float().repeat_interleave(32, -1)
    inside = y.abs() <= 1.5 * step
    err = (g.decode(fy, torch.float32) - y).abs()
    assert (err[inside] <= step[inside] / 2 * (1 + 1e-5)).all()
    assert torch.allclose(err[~inside], y.abs()[~inside] - 1.5 * step[~inside], rtol=1e-5)
    assert g.bytes_per_token(2, 64, 16) == make_format("kivi2", "v", group_size=32).bytes_per_token(2, 64, 16) - 2 * 2 * 2


def test_every_name_builds_for_both_roles() -> None:
    for name in FORMAT_NAMES:
        for role in ROLES:
            fmt = make_format(name, role)
            assert fmt.name == name and isinstance(fmt.per_token, bool)


@pytest.mark.parametrize("name, mantissa, smallest_subnormal", [("fp8_e4m3", 3, 2.0 ** -9), ("fp8_e5m2", 2, 2.0 ** -16)])
def test_head_scaled_fp8_within_half_an_ulp_of_its_fixed_scale(name: str, mantissa: int,
                                                              smallest_subnormal: float) -> None:
    """Per-head scales: each head's calibrated max maps to the code's max; inside that range the
    error is fp8's half ulp times the head's one scale; beyond it, entries saturate."""
    x = kv_data(*TOKENS)
    amax = x.abs().amax((0, 2))
    fmt = make_format(name, "k", fp8_scales="head").calibrated(amax)
    f, y = round_trip(fmt, x)
    assert set(f) == {"codes"} and fmt.bytes_per_token(3, 64, 16) == 3 * 64  # codes alone
    scale = (amax / torch.finfo(f["codes"].dtype).max)[:, None]
    assert torch.equal(fmt.head_scale, scale.squeeze(-1))
    bound = 2.0 ** -(mantissa + 1) * x.abs() + smallest_subnormal / 2 * scale
    assert_within((y - x).abs(), bound, x)
    assert torch.equal(y.abs().amax((0, 2)), amax)  # the max is exactly representable
    saturated = fmt.decode(fmt.encode(4 * x), torch.float32)
    assert torch.equal(saturated.abs().amax((0, 2)), amax)


def test_head_scaled_fp8_refuses_to_encode_before_calibration() -> None:
    fmt = make_format("fp8_e4m3", "v", fp8_scales="head")
    assert fmt.bytes_per_token(2, 64, 16) == 2 * 64  # its size is known before its scales
    with pytest.raises(RuntimeError, match="calibrate"):
        fmt.encode(torch.ones(1, 2, 64))
    assert make_format("int8", "v", fp8_scales="head").name == "int8"  # int8 keeps per-token scales
    with pytest.raises(ValueError, match="kv_fp8_scales"):
        make_format("fp8_e4m3", "v", fp8_scales="tensor")
