"""The fused C++ ops against the eager torch ops they replace (the reference semantics)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.kernels import cpu_extension
from kvserve.model.cpu_linear import kernel_layout
from kvserve.model.ops import EagerOps
from tests.torch_threads import torch_threads

kernels = cpu_extension.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="the CPU kernels could not be built here")

# fp32: the fused op rounds once where eager rounds at each op, still within fp32 noise.
# bf16: eager rounds every intermediate to bf16 (8 bits of mantissa), the kernel only the result.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
       torch.float16: dict(atol=4e-3, rtol=2e-3)}
DTYPES = [torch.float32, torch.bfloat16]


def rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


NORMS = ["rms_norm", "offset_rms_norm"]  # Llama's; Gemma's (times 1 + weight, rounded once)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("width", [96, 100])  # whole vectors; a scalar tail after them
def test_rms_norm(norm: str, dtype: torch.dtype, rows: int, width: int) -> None:
    x, w = rand(rows, width, dtype=dtype, seed=1) * 3, rand(width, dtype=dtype, seed=2)
    torch.testing.assert_close(getattr(kernels, norm)(x, w, 1e-5, None), getattr(EagerOps, norm)(x, w, 1e-5, None),
                               **TOL[dtype])


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
@pytest.mark.parametrize("width", [64, 70])
def test_rms_norm_adds_into_the_residual_first(norm: str, dtype: torch.dtype, width: int) -> None:
    x, w = rand(5, width, dtype=dtype, seed=3), rand(width, dtype=dtype, seed=4)
    res_k = rand(5, width, dtype=dtype, seed=5)
    res_e = res_k.clone()
    before = res_k.clone()
    out_k = getattr(kernels, norm)(x, w, 1e-6, res_k)
    out_e = getattr(EagerOps, norm)(x, w, 1e-6, res_e)
    # The residual stream is updated in place with exactly the dtype's sum.
    assert torch.equal(res_k, before + x) and torch.equal(res_k, res_e)
    torch.testing.assert_close(out_k, out_e, **TOL[dtype])


def rope_tables(dim: int, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    return freqs.cos(), freqs.sin()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_split_rotates_q_and_k_heads_only(dtype: torch.dtype) -> None:
    heads, kv_heads, dim = 6, 2, 32
    cos, sin = rope_tables(dim, 64)
    qkv = rand(9, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=6)
    positions = torch.tensor([0, 1, 2, 40, 63, 5, 5, 17, 30])
    fused, eager = qkv.clone(), qkv.clone()
    got = kernels.rope_split(fused, positions, cos, sin, heads, kv_heads, dim)
    want = EagerOps.rope_split(eager, positions, cos, sin, heads, kv_heads, dim)
    for g, w, n in zip(got, want, (heads, kv_heads, kv_heads)):
        assert g.shape == (9, n, dim) and g.data_ptr() >= fused.data_ptr()  # views of qkv
        torch.testing.assert_close(g, w, **TOL[dtype])
    torch.testing.assert_close(fused, eager, **TOL[dtype])
    v = slice((heads + kv_heads) * dim, None)
    assert torch.equal(fused[:, v], qkv[:, v])  # values are never rotated
    assert torch.equal(fused[0], qkv[0])  # position 0: cos 1, sin 0, the identity
    # Against the rotation written out by hand for one entry: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s).
    x1, x2 = qkv[3, 0].float(), qkv[3, 16].float()
    c, s = cos[40, 0], sin[40, 0]
    torch.testing.assert_close(fused[3, 0].float(), x1 * c - x2 * s, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_split_on_a_strided_view_of_a_larger_row(dtype: torch.dtype) -> None:
    """A [T, width] view with a longer row stride (a slice of a wider projection) works."""
    cos, sin = rope_tables(8, 8)
    wide = rand(3, 40, dtype=dtype, seed=7)
    fused, eager = wide.clone(), wide.clone()
    kernels.rope_split(fused[:, :32], torch.tensor([1, 2, 3]), cos, sin, 2, 1, 8)
    EagerOps.rope_split(eager[:, :32], torch.tensor([1, 2, 3]), cos, sin, 2, 1, 8)
    torch.testing.assert_close(fused, eager, **TOL[dtype])


# 1-8: one weight row at a time (AVX512-BF16), 9: the first count of 4 x 4 tiles; 30, 33: a last
# tile of 6 or 5 rows; with AMX, 1-16 and 17-32 rows fill one or two m tiles (70 weight rows: two
# 32-row tile blocks, then 6 by the vector path).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 30, 32, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_bf16_against_fp32_matmul(rows: int, bias: bool) -> None:
    if not kernels.has_bf16_gemm():
        pytest.skip("built without AVX512-BF16 or AVX2")
    x, w = rand(rows, 96, dtype=torch.bfloat16, seed=9), rand(70, 96, dtype=torch.bfloat16, seed=10)
    b = rand(70, dtype=torch.bfloat16, seed=11) if bias else None
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    # fp32 accumulation, one rounding to bf16 at the end: within bf16's half-ulp of the result.
    got = kernels.linear_bf16(x, kernel_layout(w, kernels), b)[:, :70]
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("op", ["silu_mul", "gelu_tanh_mul"])  # SwiGLU; GeGLU (Gemma)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spread", [0.01, 4.0, 60.0])  # 60: exp(-a) far beyond exp's polynomial range
def test_gated_activations(op: str, dtype: torch.dtype, spread: float) -> None:
    gate_up = rand(11, 2 * 80, dtype=dtype, seed=8) * spread
    torch.testing.assert_close(getattr(kernels, op)(gate_up), getattr(EagerOps, op)(gate_up), **TOL[dtype])


def argmax_cases(width: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows whose first largest value torch.argmax must be matched on: plain, ties within and
    across 256-value runs and in the short last run, NaNs (in a run, in the last run, several),
    an inf beside a -inf, all -inf, and a maximum that is negative."""
    rows = rand(12, width, dtype=torch.float32, seed=20)
    rows[1, [3, width // 2, width - 1]] = 9.0               # a tie: the first wins
    rows[2, [width - 1, width - 2]] = 9.0                   # the largest only in the last values
    rows[3, width // 3] = float("nan")
    rows[4, [width - 1, 1]] = float("nan")                  # the first NaN, not the last
    rows[5, [2, width - 3]] = torch.tensor([float("inf"), float("-inf")])
    rows[6] = float("-inf")
    rows[7] = -rows[7].abs() - 1                            # every value negative
    rows[8, width - 1] = float("nan")                       # a NaN only in the last values
    rows[9] = 0.0                                           # all tied
    rows[10, [0, width - 1]] = float("inf")
    return rows.to(dtype)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16, torch.float64])
@pytest.mark.parametrize("width", [7, 256, 700, 49152 + 13])  # under a run; one run; runs and a tail
def test_argmax_picks_what_torch_argmax_picks(dtype: torch.dtype, width: int) -> None:
    x = argmax_cases(width, dtype)
    assert torch.equal(kernels.argmax(x), x.argmax(dim=-1))
    strided = torch.cat([x, x], dim=1)[:, :width]            # rows apart in memory
    assert torch.equal(kernels.argmax(strided), x.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="argmax: x must be"):
        kernels.argmax(x.t())


def test_argmax_tells_apart_float64_values_that_float32_would_tie() -> None:
    x = torch.tensor([[1.0, 1.0 + 1e-12], [1e39, 2e39], [-1e-300, -1e-310]], dtype=torch.float64)
    assert kernels.argmax(x).tolist() == x.argmax(dim=-1).tolist() == [1, 1, 1]
    assert kernels.argmax(x[:0]).shape == (0,)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [7, 100, 49152 + 13])  # under a vector; vectors and a tail
def test_widen_is_float_exactly(dtype: torch.dtype, width: int) -> None:
    x = argmax_cases(width, torch.float32).to(dtype)  # ties, infs, NaNs
    strided = torch.cat([x, x], dim=1)[:, :width]
    for rows in (x, strided):
        got = kernels.widen(rows)
        assert got.dtype == torch.float32 and torch.equal(got.isnan(), rows.isnan())
        assert torch.equal(got.nan_to_num(), rows.float().nan_to_num())
    assert kernels.widen(got) is got  # fp32 stays itself, as .float() leaves it
    with pytest.raises(RuntimeError, match="widen: x must be"):
        kernels.widen(x.double())


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2", "int4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_encode_write_is_bit_identical_to_the_format(name: str, dtype: torch.dtype) -> None:
    """The kernel's encoder writes exactly what the format's encode gives, into the slots named."""
    from kvserve.cache.formats import make_format

    fmt = make_format(name, "k", group_size=16)
    x = rand(37, 3, 64, dtype=torch.float32, seed=12) * torch.rand(37, 3, 1) * 10
    x[:, :, 5] *= 30     # an outlier channel
    x[3, 1] = 0          # an all-zero token-head: the minimum scale
    x[4, 0] = 1e-7       # a range far below the minimum scale
    x = x.to(dtype)
    want = fmt.encode(x)
    fields = {key: torch.zeros((50, *t.shape[1:]), dtype=t.dtype) for key, t in want.items()}
    slots = torch.randperm(50, generator=torch.Generator().manual_seed(13))[:37]
    kernels.encode_write(x, slots, int(fmt.layout.kind), fields["codes"], fields["scale"],
                         fields.get("zero", torch.empty(0)), 16)
    for key, t in want.items():
        assert torch.equal(fields[key][slots].view(torch.uint8), t.view(torch.uint8)), key
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[slots] = False
    assert not fields["codes"][untouched].view(torch.uint8).any()


@pytest.mark.parametrize("name", ["int8_fit", "fp8_e4m3_fit"])
@pytest.mark.parametrize("role", ["k", "v"])  # calibrated keys (offset, weight, int8_fit's spread); plain values
@pytest.mark.parametrize("heads,dim", [(3, 64), (1, 256)])
def test_encode_fitted_write_makes_the_formats_choice(name: str, role: str, heads: int, dim: int) -> None:
    """The kernel's fitted encoder picks the format's candidate for each token and head (or, where
    a near-tie broke the other way, one of the same cost), into the slots named."""
    from kvserve.cache.formats import make_format

    g = torch.Generator().manual_seed(14)
    x = torch.randn(37, heads, dim, generator=g) * 3
    x[:, :, 5] += 20     # an outlier channel the offset takes out
    x[3, 0] = 0          # an all-zero token-head: the minimum scale
    fmt = make_format(name, role)
    if role == "k":
        a = torch.randn(heads, dim, dim, generator=g)
        fmt = fmt.calibrated(x.mean(0), a @ a.transpose(-1, -2) / dim, (x - x.mean(0)).abs().amax(0))
    x = x.to(torch.bfloat16)
    want = fmt.encode(x)
    fields = {key: torch.zeros((50, *t.shape[1:]), dtype=t.dtype) for key, t in want.items()}
    slots = torch.randperm(50, generator=torch.Generator().manual_seed(13))[:37]
    tables = fmt.layout.fit.kernel_args(torch.empty(0))
    kernels.encode_fitted_write(x, slots, fields["codes"], fields["scale"], *tables)
    got = {key: t[slots] for key, t in fields.items()}
    same = (got["scale"] == want["scale"]) & (got["codes"].float() == want["codes"].float()).all(-1)
    assert same.float().mean() > 0.97

    def cost(f: dict[str, torch.Tensor]) -> torch.Tensor:
        err = (fmt.decode(f, torch.float32) - x.float()).double()
        if fmt.spread is not None:
            err = err / fmt.spread.double()
        if fmt.weight is None:
            return err.square().sum(-1)
        return torch.einsum("thd,hde,the->th", err, fmt.weight.double(), err)

    torch.testing.assert_close(cost(got), cost(want), rtol=1e-4, atol=1e-6)
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[slots] = False
    assert not fields["codes"][untouched].view(torch.uint8).any()
    for bad in (slots[:-1], torch.full_like(slots, 50), -slots - 1):  # one slot short; past the pages; negative
        with pytest.raises(RuntimeError, match="encode_fitted_write: "):
            kernels.encode_fitted_write(x, bad, fields["codes"], fields["scale"], *tables)


def test_kernels_build_from_a_copy_in_their_cache_directory() -> None:
    """ninja rebuilds when a source's path changes: builds name the cache's own copy, so another
    install or copy of the same version reuses the build instead of compiling again."""
    directory = cpu_extension.build_dir()
    ninja = (directory / "build.ninja").read_text()
    csrc = Path(cpu_extension.__file__).parent / "csrc"
    assert {s.name for s in cpu_extension.SOURCES} == {p.name for p in csrc.iterdir() if p.suffix in (".cpp", ".h")}
    assert {"cpu_kernels.cpp", "paged_attention.cpp", "cpu_ops.h", "simd.h"} <= {s.name for s in cpu_extension.SOURCES}
    for source in cpu_extension.SOURCES:
        assert (directory / source.name).read_bytes() == source.read_bytes()
        assert str(source) not in ninja
        if source.suffix == ".cpp":
            assert str(directory / source.name) in ninja


@pytest.mark.parametrize("code_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_paged_attention_decodes_every_absmax_code_exactly(code_dtype: torch.dtype) -> None:
    """Every byte value as a value code (NaN and infinity codes aside: never stored), one key per
    sequence so the output is that key's value: the kernel's widening of int8 / fp8 codes (8 or 16
    at a time; int8 read in place) times the token's scale, applied to its weight, equals torch's
    code.float() * scale bit for bit."""
    dim, bs = 64, 16
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = raw.view(code_dtype)
    codes = torch.where(codes.float().isfinite(), codes.float(), 0.0).to(code_dtype)
    v_codes = torch.zeros(4, bs, 1, dim, dtype=code_dtype)
    v_codes[:, 0, 0] = codes.view(4, dim)
    v_scale = torch.full((4, bs, 1), 0.3717, dtype=torch.float16)
    k_codes, k_scale = torch.zeros(4, bs, 1, dim, dtype=torch.int8), torch.ones(4, bs, 1, dtype=torch.float16)
    e = torch.empty(0)
    out = kernels.paged_attention(
        torch.zeros(4, 1, dim), e, e, e, torch.arange(5), torch.ones(4, dtype=torch.long), torch.arange(4)[:, None],
        1, k_codes, k_scale, e, e, 1, v_codes, v_scale, e, e, 0, 0, 0, 0, False, False, e, e, e, e, e, e,
        e, e, e, 1.0, bs, 1, 0, e, e)
    want = v_codes[:, 0, 0].float() * v_scale[:, 0].float()
    assert torch.equal(out[:, 0], want)


@pytest.mark.parametrize("rows", [1, 5, 8])
def test_linear_bf16_gives_a_column_the_same_bits_wherever_it_sits(rows: int) -> None:
    """Up to 8 rows, a column's sums never depend on its neighbours: at 8 rows the kernel takes
    weight rows in pairs, and one weight row fewer in front pairs every column with the other
    neighbour (and leaves the last one alone)."""
    if not kernels.has_bf16_gemm():
        pytest.skip("built without AVX512-BF16 or AVX2")
    x, w = rand(rows, 256, dtype=torch.bfloat16, seed=14), rand(101, 256, dtype=torch.bfloat16, seed=15)
    b = rand(101, dtype=torch.bfloat16, seed=16)
    full = kernels.linear_bf16(x, kernel_layout(w, kernels), b)[:, :101]
    shifted = kernels.linear_bf16(x, kernel_layout(w[1:], kernels), b[1:])[:, :100]
    assert torch.equal(full[:, 1:], shifted)


@pytest.mark.parametrize("rows", [1, 6, 8, 33, 70])  # 8: two weight rows at a time
def test_linear_bf16_gives_the_same_bits_on_any_thread_count(rows: int) -> None:
    """Parallel test workers run one thread each: here the kernel's split of the output columns
    across threads is checked (1030 columns: full tiles on both threads and a tail)."""
    if not kernels.has_bf16_gemm():
        pytest.skip("built without AVX512-BF16 or AVX2")
    x, w = rand(rows, 256, dtype=torch.bfloat16, seed=12), rand(1030, 256, dtype=torch.bfloat16, seed=13)
    outs = []
    for threads in (1, 2, 3):
        with torch_threads(threads):
            outs.append(kernels.linear_bf16(x, kernel_layout(w, kernels), None))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
