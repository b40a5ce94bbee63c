"""The CPU linears: oneDNN calls split into bounded row counts give the rows one matmul gives; the
small-batch linear gives F.linear's rows on both sides of its row limit."""
from __future__ import annotations

import pytest
import torch

from kvserve.kernels import cpu_extension
from kvserve.model.cpu_linear import (GROUP, ROW_BUCKET, SMALL_BATCH, InterleavedEmbedding, PackedLinear,
                                      SmallBatchLinear, cpu_linear, cpu_linear_kind, interleave_rows, onednn_packs,
                                      onednn_rows, replace_linears)
from kvserve.model.config import ModelConfig
from kvserve.model.llama import LlamaForCausalLM


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


def bf16_gemm_kernels() -> object:
    kernels = cpu_extension.load()
    if kernels is None or not kernels.has_bf16_gemm():
        pytest.skip("needs the CPU kernels with AVX512-BF16 or AVX2")
    return kernels


@pytest.mark.parametrize("rows", [1, 5, SMALL_BATCH, SMALL_BATCH + 1])
@pytest.mark.parametrize("out_features", [96, 100])  # 100: the AVX2 kernel's weight padded to 112 rows
def test_small_batch_linear_equals_f_linear_on_both_sides_of_its_row_limit(rows: int, out_features: int) -> None:
    kernels = bf16_gemm_kernels()
    linear = torch.nn.Linear(64, out_features, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
    got = SmallBatchLinear(linear, kernels)(x)
    assert got.shape == (rows, out_features) and got.is_contiguous()
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_a_linear_the_kernel_cannot_read_keeps_a_path_that_can() -> None:
    kernels = bf16_gemm_kernels()
    linear = torch.nn.Linear(48, 64, bias=True).to(torch.bfloat16)  # 48: not a multiple of 32
    new = cpu_linear(linear, "small-batch", kernels)
    assert not isinstance(new, SmallBatchLinear)
    x = torch.randn(3, 48, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
    torch.testing.assert_close(new(x).float(), want, atol=2e-2, rtol=2e-2)


def interleaving_kernels() -> object:
    kernels = cpu_extension.load()
    if kernels is None or not kernels.interleaves_bf16_weights():
        pytest.skip("needs the AVX2 kernel (a CPU without AVX512-BF16)")
    return kernels


def test_interleaved_rows_put_each_group_of_16_rows_side_by_side_in_pairs_of_k() -> None:
    w = torch.arange(29 * 32, dtype=torch.float32).view(29, 32)
    packed = interleave_rows(w)
    assert packed.shape == (2, 16, 16, 2)
    # Group g, pair p, row j: weights [2 p, 2 p + 2) of row 16 g + j, worked by hand for one;
    # rows 29-31 are zeros.
    assert torch.equal(packed[1, 5, 11], w[27, 10:12])
    assert not packed[1, :, 13:].any()
    assert torch.equal(rows_of(packed)[:29], w)


def rows_of(interleaved: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight back from its interleaved layout (N padded as it is)."""
    groups, pairs = interleaved.shape[:2]
    return interleaved.transpose(1, 2).reshape(groups * GROUP, pairs * 2)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n", [1028, 1020])  # 65 groups of 16 (32 pairs and one); 64 (the last pair padded)
def test_each_row_of_the_avx2_kernel_is_the_same_bits_alone_or_with_any_other_rows(bias: bool, n: int) -> None:
    """Batch invariance: every tile shape (4, 3, 2 and 1 rows against a group; one row against
    two groups) sums a row's products in one order."""
    kernels = interleaving_kernels()
    w = torch.randn(n, 96).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    x = torch.randn(70, 96).bfloat16()
    packed = interleave_rows(w)
    alone = torch.cat([kernels.linear_bf16(x[i:i + 1], packed, b) for i in range(70)])
    for rows in (2, 3, 4, 7, 33, 70):  # past SMALL_BATCH too: the kernel takes every batch
        assert torch.equal(kernels.linear_bf16(x[:rows], packed, b), alone[:rows])
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(alone[:, :n].float(), want, atol=1e-2, rtol=8e-3)
    assert not alone[:, n:].any()


def test_a_tied_lm_head_is_interleaved_once_and_the_embedding_reads_it() -> None:
    kernels = interleaving_kernels()
    cfg = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position=64, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.lm_head.weight = model.model.embed_tokens.weight
    table = model.model.embed_tokens.weight.detach().clone()
    want = model.model.layers[0].mlp.gate_up_proj.weight.detach().clone()
    replace_linears(model, "small-batch", kernels)
    embed = model.model.embed_tokens
    assert isinstance(embed, InterleavedEmbedding) and embed.weight.data_ptr() == model.lm_head.weight.data_ptr()
    ids = torch.tensor([[0, 7, 8, 99], [42, 3, 3, 64]])
    assert torch.equal(embed(ids), table[ids])
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(model.lm_head(x).float(), x.float() @ table.float().T, atol=2e-2, rtol=2e-2)
    gate_up = model.model.layers[0].mlp.gate_up_proj
    assert gate_up.weight.dim() == 4 and torch.equal(rows_of(gate_up.weight), want)


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
