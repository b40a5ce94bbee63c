"""kv_rotation: an orthogonal rotation of q, k and v before the pages leaves attention unchanged
(fp32, every backend) and lets quantized pages lose less on keys with outlier channels."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvserve import LLM
from kvserve.attention.rotation import rotate, rotation_matrix
from kvserve.attention.selector import BACKENDS
from kvserve.cache.formats import make_format
from kvserve.eval.quality import forced_logprobs
from tests.backend_cases import backend_device, heavy_case

WINDOWS = [[(5 * i + 3 * j + j * j) % 128 for j in range(60)] for i in range(3)]


@pytest.mark.parametrize("kind, dim", [("hadamard", 16), ("hadamard", 64), ("random", 80)])
def test_the_rotations_are_orthogonal(kind: str, dim: int) -> None:
    r = rotation_matrix(kind, dim, seed=1)
    assert r is not None and r.shape == (dim, dim)
    torch.testing.assert_close(r @ r.T, torch.eye(dim), atol=1e-5, rtol=0)
    if kind == "hadamard":  # every entry +-1/sqrt(dim): a channel's energy is spread over all
        torch.testing.assert_close(r.abs(), torch.full((dim, dim), dim ** -0.5))
    assert rotation_matrix("none", dim, seed=1) is None


def test_bad_rotations_name_the_field(tiny_llm: Callable[..., LLM]) -> None:
    with pytest.raises(ValueError, match="EngineConfig.kv_rotation.*power-of-two"):
        rotation_matrix("hadamard", 80, seed=0)
    with pytest.raises(ValueError, match="KVFormatOptions.kv_rotation must be one of"):
        tiny_llm(kv_rotation="givens")


@pytest.mark.parametrize("backend, pages", [
    heavy_case(b, pages, backend=b, id=f"{b}-{pages or 'dense'}")
    for b in BACKENDS for pages in ("", "int8") if not (b == "triton" and pages)])
@pytest.mark.parametrize("kind, keys", [("hadamard", True), ("random", True), ("hadamard", False)])
def test_rotated_pages_give_the_same_attention(tiny_llm: Callable[..., LLM], backend: str, pages: str,
                                               kind: str, keys: bool) -> None:
    """Dense pages: the same distributions within fp32 rounding, with q and k rotated or values
    alone. int8 pages: the codes are of other vectors, so only close (within int8's own error
    against dense pages)."""
    fmt = dict(kv_cache_dtype=pages) if pages else {}
    run = dict(max_num_seqs=3, attention_backend=backend, cpu_kernels=backend != "torch", device=backend_device(backend),
               **fmt)
    want = forced_logprobs(tiny_llm(**run), WINDOWS, prefill_len=25)
    got = forced_logprobs(tiny_llm(kv_rotation=kind, kv_rotate_keys=keys, **run), WINDOWS, prefill_len=25)
    if not pages:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:
        dense = forced_logprobs(tiny_llm(max_num_seqs=3, attention_backend=backend, cpu_kernels=backend != "torch",
                                         device=backend_device(backend)), WINDOWS, prefill_len=25)
        assert (got - want).abs().max() <= 4 * (want - dense).abs().max() + 1e-4


@pytest.mark.parametrize("name", ["int4", "int8"])  # fp8 keeps a per-value exponent: no gain
def test_rotation_spreads_an_outlier_channel_before_quantization(name: str) -> None:
    """Keys with one channel 30x the others (what real models' keys look like): quantized
    per token, the rotated keys come back (rotated back) closer than the plain ones."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(256, 3, 64, generator=g)
    k[..., 7] *= 30
    fmt = make_format(name, "k", group_size=32)
    r = rotation_matrix("hadamard", 64, seed=0)
    plain = fmt.decode(fmt.encode(k), torch.float32)
    rotated = rotate(fmt.decode(fmt.encode(rotate(k, r)), torch.float32), r.T)
    err_plain, err_rotated = (plain - k).norm(), (rotated - k).norm()
    assert err_rotated < 0.7 * err_plain, (err_rotated, err_plain)
