"""Sliding-window attention in the torch backend against transformers' own mask functions, and a
backend that has no window mask: refused by name, passed over by "auto" (the kernels' windows:
test_window_kernels.py)."""
from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

from kvserve.attention import StepAttention, StepMetadata, selector
from kvserve.attention.backend import AttentionBackend
from kvserve.attention.cpu_paged import CPUPagedBackend
from kvserve.attention.selector import make_backend as select_backend
from kvserve.attention.torch_sdpa import TorchSDPABackend
from kvserve.cache.kv_pool import KVPool
from kvserve.kernels import cpu_extension
from tests.attention.test_backends import CPU, SeqData, make_backend, make_case, write_context

HEADS, KV_HEADS, BLOCK = 4, 1, 4
# Prefill past the window, a chunk whose queries straddle the window's edge, a decode step deep in
# the context, and a sequence shorter than the window: one step, padded grid.
SHAPES = [(13, 13), (21, 6), (30, 1), (5, 2)]


def hf_reference(seq: SeqData, window: int, scale: float, heads: int = HEADS,
                 kv_heads: int = KV_HEADS) -> torch.Tensor:
    """Attention of the new queries with transformers' sliding-window causal mask, evaluated by its
    own mask functions over the (query position, key position) grid: [q_len, heads, D]."""
    allowed = and_masks(causal_mask_function, sliding_window_overlay(window))
    mask = allowed(0, 0, torch.arange(seq.ctx - seq.q_len, seq.ctx)[:, None], torch.arange(seq.ctx)[None, :])
    group = heads // kv_heads
    k = seq.k.repeat_interleave(group, dim=1).transpose(0, 1)
    v = seq.v.repeat_interleave(group, dim=1).transpose(0, 1)
    return F.scaled_dot_product_attention(seq.q.transpose(0, 1), k, v, attn_mask=mask, scale=scale).transpose(0, 1)


def windowed_step(window: int | None) -> tuple[torch.Tensor, list[SeqData]]:
    """The torch backend's output over SHAPES through `StepAttention` with the layer's window."""
    seqs, k0, v0 = make_case(SHAPES, HEADS, KV_HEADS, BLOCK, seed=1)
    backend = make_backend("torch", k0, v0, HEADS)
    write_context(backend, seqs, HEADS, BLOCK)
    step = StepMetadata.build([s.q_len for s in seqs], [s.ctx for s in seqs], [s.table for s in seqs], BLOCK, CPU)
    new = [torch.cat([getattr(s, x)[s.ctx - s.q_len:] for s in seqs]) for x in ("k", "v")]
    attention = StepAttention.of(backend, step)
    return attention(0, torch.cat([s.q for s in seqs]), *new, 1 / math.sqrt(32), window), seqs


@pytest.mark.parametrize("window", [1, 4, 8])
def test_the_window_mask_is_transformers(window: int) -> None:
    """A query at position p sees keys p - window + 1 .. p (window 1: itself alone)."""
    out, seqs = windowed_step(window)
    ref = torch.cat([hf_reference(s, window, 1 / math.sqrt(32)) for s in seqs])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_a_window_covering_the_context_changes_nothing_and_a_short_one_does() -> None:
    full, _ = windowed_step(None)
    torch.testing.assert_close(windowed_step(30)[0], full, atol=0, rtol=0)
    assert (windowed_step(4)[0] - full).abs().max().item() > 1e-2


@pytest.mark.parametrize("name", list(selector.BACKENDS))
def test_a_sequence_with_evicted_tokens_is_refused(name: str) -> None:
    """Its slots no longer sit at their positions, and the window is a span of positions."""
    pool = KVPool(1, 4, BLOCK, KV_HEADS, 32, torch.float32, CPU)
    if (reason := selector.BACKENDS[name].unsupported(pool, CPU)) is not None:
        pytest.skip(f"{name}: {reason}")
    backend = selector.BACKENDS[name](pool, HEADS)
    step = StepMetadata.build([1], [6], [[0, 1]], BLOCK, CPU, evicted=[3])
    assert step.evicts
    with pytest.raises(ValueError, match="kv_eviction: a sliding window"):
        backend.with_window(backend.prepare(step), 4)
    assert not dataclasses.replace(step, evicts=False).evicts


class NoWindowBackend(TorchSDPABackend):
    """A backend without a sliding-window mask (every built-in one has one)."""
    name = "nowindow"
    masks_window = False
    with_window = AttentionBackend.with_window


def test_a_backend_without_a_window_mask_is_refused_or_passed_over(caplog: pytest.LogCaptureFixture,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(selector.BACKENDS, "nowindow", NoWindowBackend)
    monkeypatch.setitem(selector.AUTO_ORDER, "cpu", ("nowindow", "torch"))
    pool = KVPool(2, 4, BLOCK, KV_HEADS, 32, torch.float32, CPU)
    with pytest.raises(ValueError, match="attention_backend: 'nowindow' cannot serve .* no sliding-window mask"):
        select_backend("nowindow", pool, HEADS, CPU, windowed=True)
    with caplog.at_level(logging.INFO, logger="kvserve.attention.selector"):
        chosen = select_backend("auto", pool, HEADS, CPU, windowed=True)
    assert isinstance(chosen, TorchSDPABackend) and "nowindow: no sliding-window mask" in caplog.text
    assert isinstance(select_backend("auto", pool, HEADS, CPU, windowed=False), NoWindowBackend)


def test_a_windowed_layer_reaching_a_backend_without_a_mask_is_refused_naming_the_option() -> None:
    """Where the engine did not say the model is windowed, the layer's call still never runs
    full attention."""
    backend = NoWindowBackend(KVPool(1, 4, BLOCK, KV_HEADS, 32, torch.float32, CPU), HEADS)
    attention = StepAttention.of(backend, StepMetadata.build([1], [1], [[0]], BLOCK, CPU))
    x = torch.zeros(1, KV_HEADS, 32)
    with pytest.raises(ValueError, match="attention_backend: the nowindow backend has no sliding-window mask"):
        attention(0, torch.zeros(1, HEADS, 32), x, x, 1.0, 8)


@pytest.mark.skipif(cpu_extension.load() is None, reason="needs the compiled CPU kernels")
def test_auto_picks_the_cpu_kernel_for_a_windowed_model_on_the_cpu() -> None:
    pool = KVPool(2, 4, BLOCK, KV_HEADS, 32, torch.float32, CPU)
    assert isinstance(select_backend("auto", pool, HEADS, CPU, windowed=True), CPUPagedBackend)
