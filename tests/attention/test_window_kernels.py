"""The cpu and Triton kernels' sliding windows: over dense pages equal to transformers' mask, over
int8 and int4 codes equal to the torch backend's window, for prefill, chunked prefill and decode
steps, windows of one key, shorter and longer than a block, and longer than every context, with
Gemma 3 270M's heads (four query heads on one KV head of 256 channels) and a smaller GQA shape.
Triton runs in its interpreter here (TRITON_INTERPRET=1, tests/conftest.py) and is skipped where it
is not installed.

A hybrid KV cache points a sliding layer's table entries for blocks wholly before the window at a
null block 0: filled with NaN here, the outputs stay the same, so the kernels never read them."""
from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from kvserve.attention import StepAttention, StepMetadata
from kvserve.attention.backend import Pool
from kvserve.attention.selector import BACKENDS
from kvserve.cache.formats import make_format
from kvserve.cache.kv_pool import KVPool
from kvserve.cache.quantized_pool import QuantizedKVPool
from tests.attention.test_backends import CPU, SeqData, blocks_for
from tests.attention.test_window import hf_reference
from tests.torch_threads import torch_threads

KERNELS = ["cpu", "triton"]
# (query heads, KV heads, head_dim)
LAYOUTS = {"gemma3-270m": (4, 1, 256), "gqa": (8, 2, 32)}
# (context, new tokens) per sequence of one step; each kind has a sequence shorter than some windows.
STEPS = {"prefill": [(40, 40), (5, 5)], "chunked": [(50, 7), (30, 13), (9, 4)], "decode": [(62, 1), (3, 1), (35, 1)]}
# (block size, window): one key; shorter than a block; longer than one; longer than every context.
WINDOWS = [(16, 1), (16, 5), (4, 5), (4, 24), (16, 24), (16, 4096)]
# Decodes past 512 keys (the cpu kernel cuts them into pieces, the Triton one into splits) whose
# windows start mid-context, beside a prefill.
LONG = [(1300, 1), (700, 1), (40, 40)]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    with torch_threads(1):  # tiny tensors on a shared 2-core machine: threads only spin
        yield


def make_seqs(shapes: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, block_size: int,
              dtype: torch.dtype) -> tuple[list[SeqData], int]:
    """Random sequences (values of `dtype`, held in fp32) over shuffled blocks, none of them block 0
    (the null block); and the pool's size."""
    gen = torch.Generator().manual_seed(0)
    needed = sum(blocks_for(ctx, block_size) for ctx, _ in shapes)
    free = (torch.randperm(needed, generator=gen) + 1).tolist()
    seqs = []
    for ctx, q_len in shapes:
        n = blocks_for(ctx, block_size)
        k, v, q = (torch.randn(shape, generator=gen).to(dtype).float()
                   for shape in ((ctx, kv_heads, dim), (ctx, kv_heads, dim), (q_len, heads, dim)))
        seqs.append(SeqData(ctx, q_len, k, v, q, free[:n]))
        free = free[n:]
    return seqs, needed + 1


def make_pool(fmt: str, num_blocks: int, block_size: int, kv_heads: int, dim: int, dtype: torch.dtype) -> Pool:
    if fmt == "dense":
        return KVPool(1, num_blocks, block_size, kv_heads, dim, dtype, CPU)
    formats = make_format(fmt, "k", group_size=16), make_format(fmt, "v", group_size=16)
    return QuantizedKVPool(num_blocks, block_size, kv_heads, dim, dtype, CPU, [formats], 0, 0)


def null_table(seq: SeqData, block_size: int, window: int) -> list[int]:
    """`seq`'s table with the blocks wholly before its first new token's window pointing at block 0."""
    first_key = max(0, seq.ctx - seq.q_len - window + 1)
    return [0 if (i + 1) * block_size <= first_key else block for i, block in enumerate(seq.table)]


def poison_block_zero(pool: Pool) -> None:
    """NaN in every float of block 0: values of dense pages, scales and zero-points of codes."""
    kv = pool.kv[0]
    tensors = [kv.k, kv.v] if isinstance(pool, KVPool) else [t for fields in kv.fields for t in fields.values()]
    for t in tensors:
        if t.is_floating_point():
            t[0] = math.nan


def windowed_step(name: str, fmt: str, layout: str, shapes: list[tuple[int, int]], block_size: int, window: int,
                  null: bool = False, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, list[SeqData]]:
    """Backend `name`'s output for one step over `shapes` through a layer of `window` (the engine's
    path: `StepAttention`), after the pool wrote each sequence's earlier tokens (as a prefill's
    backend would, without attending). `null`: the step's tables point their blocks before the
    window at block 0, full of NaN."""
    heads, kv_heads, dim = LAYOUTS[layout]
    seqs, num_blocks = make_seqs(shapes, heads, kv_heads, dim, block_size, dtype)
    pool = make_pool(fmt, num_blocks, block_size, kv_heads, dim, dtype)
    if (reason := BACKENDS[name].unsupported(pool, CPU)) is not None:
        pytest.skip(f"{name}: {reason}")
    backend = BACKENDS[name](pool, heads)
    plan = None if isinstance(pool, KVPool) else pool.write_plan(None)
    prior = [s for s in seqs if s.ctx > s.q_len]
    if prior:
        lens = [s.ctx - s.q_len for s in prior]
        step = StepMetadata.build(lens, lens, [s.table for s in prior], block_size, CPU, kv_plan=plan)
        pool.kv[0].write(*(torch.cat([getattr(s, x)[:-s.q_len] for s in prior]).to(dtype) for x in ("k", "v")), step)
        pool.kv[0].seal(step)
    tables = [s.table for s in seqs]
    if null:
        tables = [null_table(s, block_size, window) for s in seqs]
        assert tables != [s.table for s in seqs], "no block lies before the window: the test proves nothing"
        poison_block_zero(pool)
    step = StepMetadata.build([s.q_len for s in seqs], [s.ctx for s in seqs], tables, block_size, CPU, kv_plan=plan)
    new = [torch.cat([getattr(s, x)[s.ctx - s.q_len:] for s in seqs]).to(dtype) for x in ("k", "v")]
    out = StepAttention.of(backend, step)(0, torch.cat([s.q for s in seqs]).to(dtype), *new, dim ** -0.5, window)
    return out.float(), seqs


def reference(seqs: list[SeqData], layout: str, window: int) -> torch.Tensor:
    heads, kv_heads, dim = LAYOUTS[layout]
    return torch.cat([hf_reference(s, window, dim ** -0.5, heads, kv_heads) for s in seqs])


@pytest.mark.parametrize("block_size,window", WINDOWS)
@pytest.mark.parametrize("kind", list(STEPS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", KERNELS)
def test_dense_pages_equal_transformers_window(name: str, layout: str, kind: str, block_size: int,
                                               window: int) -> None:
    out, seqs = windowed_step(name, "dense", layout, STEPS[kind], block_size, window)
    torch.testing.assert_close(out, reference(seqs, layout, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size,window", [(4, 5), (16, 24)])
@pytest.mark.parametrize("kind", ["chunked", "decode"])
@pytest.mark.parametrize("name", KERNELS)
def test_bf16_pages_equal_transformers_window(name: str, kind: str, block_size: int, window: int) -> None:
    """bf16 pages, which the cpu kernel's decode items read in place from the window's first key."""
    out, seqs = windowed_step(name, "dense", "gemma3-270m", STEPS[kind], block_size, window, dtype=torch.bfloat16)
    torch.testing.assert_close(out, reference(seqs, "gemma3-270m", window), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("block_size,window", [(16, 5), (4, 24)])
@pytest.mark.parametrize("kind", list(STEPS))
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("name", KERNELS)
def test_codes_equal_the_torch_backends_window(name: str, fmt: str, kind: str, block_size: int, window: int) -> None:
    out, _ = windowed_step(name, fmt, "gemma3-270m", STEPS[kind], block_size, window)
    want, _ = windowed_step("torch", fmt, "gemma3-270m", STEPS[kind], block_size, window)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size,window", [(16, 1), (4, 5), (16, 24)])
@pytest.mark.parametrize("kind", ["chunked", "decode"])  # a prefill's first token sees every block
@pytest.mark.parametrize("fmt", ["dense", "int8"])
@pytest.mark.parametrize("name", KERNELS)
def test_blocks_before_the_window_are_never_read(name: str, fmt: str, kind: str, block_size: int,
                                                 window: int) -> None:
    out, _ = windowed_step(name, fmt, "gemma3-270m", STEPS[kind], block_size, window, null=True)
    assert out.isfinite().all()
    torch.testing.assert_close(out, windowed_step(name, fmt, "gemma3-270m", STEPS[kind], block_size, window)[0],
                               atol=0, rtol=0)


@pytest.mark.parametrize("window", [600, 513])
@pytest.mark.parametrize("name", KERNELS)
def test_long_decodes_split_from_the_window_on(name: str, window: int) -> None:
    """The context's pieces (cpu) or splits (Triton) cover the window alone: with its earlier
    blocks on the NaN block, each merges to transformers' output."""
    out, seqs = windowed_step(name, "dense", "gqa", LONG, 16, window, null=True)
    torch.testing.assert_close(out, reference(seqs, "gqa", window), atol=1e-5, rtol=1e-5)
