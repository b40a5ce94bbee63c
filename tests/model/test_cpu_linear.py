"""The CPU linears: oneDNN calls split into bounded row counts give the rows one matmul gives; the
small-batch linear gives F.linear's rows on both sides of its row limit."""
from __future__ import annotations

import pytest
import torch

from kvserve.kernels import cpu_extension
from kvserve.model.cpu_linear import (ROW_BUCKET, SMALL_BATCH, PackedLinear, SmallBatchLinear, cpu_linear_kind,
                                      onednn_packs, onednn_rows)


@pytest.mark.parametrize("rows", [1, 33, ROW_BUCKET, ROW_BUCKET + 1, 200])
def test_onednn_rows_sees_bounded_row_counts_and_returns_every_row(rows: int) -> None:
    x = torch.randn(rows, 24)
    w = torch.randn(40, 24)
    seen: list[int] = []

    def matmul(padded: torch.Tensor) -> torch.Tensor:
        seen.append(padded.shape[0])
        return padded @ w.T

    out = onednn_rows(x, matmul)
    assert sum(seen) == rows and len(seen) <= 2
    assert all(n % ROW_BUCKET == 0 or n < ROW_BUCKET for n in seen)
    torch.testing.assert_close(out, x @ w.T)


@pytest.mark.skipif(not onednn_packs(torch.bfloat16), reason="needs oneDNN's bf16 prepacking (AVX-512)")
@pytest.mark.parametrize("rows", [3, 70])
def test_packed_linear_equals_f_linear(rows: int) -> None:
    linear = torch.nn.Linear(64, 96, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
    torch.testing.assert_close(PackedLinear(linear)(x).float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("rows", [1, 5, SMALL_BATCH, SMALL_BATCH + 1])
def test_small_batch_linear_equals_f_linear_on_both_sides_of_its_row_limit(rows: int) -> None:
    kernels = cpu_extension.load()
    if kernels is None or not kernels.has_bf16_gemm():
        pytest.skip("needs the CPU kernels with AVX512-BF16 or AVX2")
    linear = torch.nn.Linear(64, 96, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
    torch.testing.assert_close(SmallBatchLinear(linear, kernels)(x).float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_linear_kind_never_asks_onednn_for_a_prepack_it_cannot_make(dtype: torch.dtype) -> None:
    """Without the kernels, a CPU whose oneDNN cannot prepack the dtype (AVX2 only) keeps
    nn.Linear instead of failing at load; where it can, the weights are prepacked."""
    kind = cpu_linear_kind(torch.device("cpu"), dtype, None)
    assert kind == ("packed" if onednn_packs(dtype) else None)
    if kind == "packed":
        PackedLinear(torch.nn.Linear(16, 16).to(dtype))
    else:
        with pytest.raises(RuntimeError):
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype))
