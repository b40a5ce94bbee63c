"""The CPU linears: padded oneDNN calls give the rows an unpadded matmul gives."""
from __future__ import annotations

import pytest
import torch

from kvserve.model.cpu_linear import ROW_BUCKET, PackedLinear, onednn_rows


@pytest.mark.parametrize("rows", [1, 33, ROW_BUCKET, ROW_BUCKET + 1, 200])
def test_onednn_rows_pads_to_a_bucket_and_returns_the_real_rows(rows: int) -> None:
    x = torch.randn(rows, 24)
    w = torch.randn(40, 24)
    seen: list[int] = []

    def matmul(padded: torch.Tensor) -> torch.Tensor:
        seen.append(padded.shape[0])
        return padded @ w.T

    out = onednn_rows(x, matmul)
    assert seen[0] % ROW_BUCKET == 0 and rows <= seen[0] < rows + ROW_BUCKET
    torch.testing.assert_close(out, x @ w.T)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
@pytest.mark.parametrize("rows", [3, 70])
def test_packed_linear_equals_f_linear(rows: int) -> None:
    linear = torch.nn.Linear(64, 96, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
    torch.testing.assert_close(PackedLinear(linear)(x).float(), want, atol=2e-2, rtol=2e-2)
