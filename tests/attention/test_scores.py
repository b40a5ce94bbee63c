"""The attention scores eviction policies rank by, against a loop over rows and heads."""
from __future__ import annotations

import pytest
import torch

from kvserve.attention.cpu_paged import CPUPagedBackend
from kvserve.attention.metadata import StepMetadata
from kvserve.attention.scores import ScorePlan, slot_scores
from kvserve.cache.kv_pool import KVPool


def test_slot_scores_equal_a_softmax_per_row_and_head() -> None:
    torch.manual_seed(0)
    bs, kv_heads, heads, dim = 4, 2, 6, 8
    pool = KVPool(1, 16, bs, kv_heads, dim, torch.float32, torch.device("cpu"))
    pool.layers[0][0].normal_()
    # Three sequences: a prompt chunk of 5 on 3 cached slots, a decode on 9 slots, a prefill of 6.
    q_lens, ctx = [5, 1, 6], [8, 9, 6]
    tables = [[3, 7], [0, 1, 2], [9, 12]]
    step = StepMetadata.build(q_lens, ctx, tables, bs, torch.device("cpu"))
    q = torch.randn(sum(q_lens), heads, dim)
    first = {0: 2, 2: 0}  # sequence 0 counts its queries from its third row, sequence 2 all of them
    plan = ScorePlan.build(step, first)
    got = slot_scores(pool.kv[0], q, plan, scale=0.3)
    keys = pool.layers[0][0]
    starts = [0, 5, 6]
    for n, b in enumerate(sorted(first)):
        want = torch.zeros(kv_heads, max(ctx[i] for i in first))
        slot_keys = torch.stack([keys[tables[b][s // bs], s % bs] for s in range(ctx[b])])  # [S, kvh, D]
        for row in range(first[b], q_lens[b]):
            visible = ctx[b] - q_lens[b] + row + 1
            for head in range(heads):
                kvh = head // (heads // kv_heads)
                logits = slot_keys[:visible, kvh] @ q[starts[b] + row, head] * 0.3
                want[kvh, :visible] += logits.softmax(0) / (heads // kv_heads)
        torch.testing.assert_close(got[n], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv_heads, heads", [(2, 6), (1, 4), (3, 3)])
def test_the_cpu_kernel_scores_equal_the_torch_scores(kv_heads: int, heads: int) -> None:
    """The C++ kernel's second pass (weights from its final softmax) against slot_scores, on the
    same step: a prompt chunk over cached slots, a decode, an unscored sequence, a prefill."""
    if CPUPagedBackend.unsupported(KVPool(1, 1, 4, 1, 8, torch.float32, torch.device("cpu")),
                                   torch.device("cpu")):
        pytest.skip("no C++ kernels here")
    torch.manual_seed(1)
    bs, dim = 4, 8
    pool = KVPool(1, 24, bs, kv_heads, dim, torch.float32, torch.device("cpu"))
    pool.layers[0][0].normal_()
    pool.layers[0][1].normal_()
    q_lens, ctx = [5, 1, 2, 6], [8, 9, 7, 6]
    tables = [[3, 7], [0, 1, 2], [4, 5], [9, 12]]
    step = StepMetadata.build(q_lens, ctx, tables, bs, torch.device("cpu"))
    q = torch.randn(sum(q_lens), heads, dim)
    k, v = torch.randn(sum(q_lens), kv_heads, dim), torch.randn(sum(q_lens), kv_heads, dim)
    plan = ScorePlan.build(step, {0: 2, 1: 0, 3: 0})
    backend = CPUPagedBackend(pool, heads)
    out, got = backend.forward_scored(0, q, k, v, backend.prepare(step), 0.3, plan)
    want = slot_scores(pool.kv[0], q, plan, scale=0.3)  # the pages now hold the step's k, v
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, backend.forward(0, q, k, v, backend.prepare(step), 0.3))
