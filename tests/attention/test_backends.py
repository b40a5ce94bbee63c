"""Every attention backend against a dense causal reference.

The reference never touches the pool: it runs `scaled_dot_product_attention` per sequence on
contiguous K/V with each KV head repeated for its query heads (what Llama's `repeat_kv` does),
so any mistake in slot mapping, block-table reading, masking or head grouping shows up as a
numeric mismatch.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kvserve.attention import StepMetadata
from kvserve.attention.backend import AttentionBackend
from kvserve.attention.selector import BACKENDS
from kvserve.bench.peer_weights import cpu_flags
from kvserve.cache.formats import KVFormat, make_format
from kvserve.cache.kv_pool import KVPool
from tests.torch_threads import torch_threads

HEAD_DIM = 32
ATOL = RTOL = 1e-5
CPU = torch.device("cpu")
# On a GPU the pages and kernels live there (the triton backend runs compiled, the cpu one skips).
DEVICE = torch.device("cuda") if torch.cuda.is_available() else CPU
BACKEND_NAMES = list(BACKENDS)


def make_backend(name: str, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                 missing_ok: bool = False) -> AttentionBackend | None:
    """A one-layer dense pool holding (not copying) the given K/V pages. A backend that does not
    serve it skips the test, or with `missing_ok` is None."""
    num_blocks, block_size, kv_heads, dim = k_cache.shape
    pool = KVPool(1, num_blocks, block_size, kv_heads, dim, k_cache.dtype, k_cache.device)
    pool.kv[0].k, pool.kv[0].v = k_cache, v_cache
    if (reason := BACKENDS[name].unsupported(pool, k_cache.device)) is not None:
        if missing_ok:
            return None
        pytest.skip(f"{name}: {reason}")
    return BACKENDS[name](pool, heads)


def attend(backend: AttentionBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           step: StepMetadata, scale: float) -> torch.Tensor:
    device = backend.pool.kv[0].k.device
    return backend.forward(0, q.to(device), k.to(device), v.to(device), backend.prepare(step), scale).cpu()


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    # These tensors are tiny; on a 2-core machine shared with other work, torch's intra-op
    # threads spin against each other and a 10 ms case takes 400 ms. One thread is faster here.
    with torch_threads(1):
        yield


@dataclass
class SeqData:
    """One sequence of a step: `ctx` tokens in total, the last `q_len` of them new this step."""
    ctx: int
    q_len: int
    k: torch.Tensor       # [ctx, kv_heads, D], K of every token of the sequence
    v: torch.Tensor       # [ctx, kv_heads, D]
    q: torch.Tensor       # [q_len, heads, D], queries of the new tokens
    table: list[int]      # block ids, in sequence order


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def make_case(shapes: list[tuple[int, int]], heads: int, kv_heads: int, block_size: int,
              seed: int, head_dim: int = HEAD_DIM) -> tuple[list[SeqData], torch.Tensor, torch.Tensor]:
    """Random sequences plus a pool filled with garbage.

    Blocks are handed out from a random permutation of the pool, so tables are neither sorted
    nor contiguous, and block 0 (the padding id of shorter tables) may belong to someone else.
    The pool starts as random garbage rather than zeros so that reading an unowned slot (a
    padded table entry, or the unused tail of a sequence's last block) changes the result.
    """
    gen = torch.Generator().manual_seed(seed)
    needed = sum(blocks_for(ctx, block_size) for ctx, _ in shapes)
    num_blocks = needed + 3  # a few blocks no one owns
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    seqs: list[SeqData] = []
    for ctx, q_len in shapes:
        n = blocks_for(ctx, block_size)
        table, perm = perm[:n], perm[n:]
        seqs.append(SeqData(
            ctx, q_len,
            k=torch.randn(ctx, kv_heads, head_dim, generator=gen),
            v=torch.randn(ctx, kv_heads, head_dim, generator=gen),
            q=torch.randn(q_len, heads, head_dim, generator=gen),
            table=table))
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    return seqs, k_cache, v_cache


def dense_reference(seq: SeqData, heads: int, kv_heads: int, scale: float) -> torch.Tensor:
    """Causal attention of the new queries over all `ctx` keys: [q_len, heads, D]."""
    group = heads // kv_heads
    k = seq.k.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, D]
    v = seq.v.repeat_interleave(group, dim=1).transpose(0, 1)
    q = seq.q.transpose(0, 1)                                   # [heads, q_len, D]
    # New token j sits at position ctx - q_len + j and sees keys 0..that position.
    q_pos = torch.arange(seq.ctx - seq.q_len, seq.ctx)[:, None]
    mask = torch.arange(seq.ctx)[None, :] <= q_pos
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def write_context(backend: AttentionBackend, seqs: list[SeqData], heads: int, block_size: int) -> None:
    """Put each sequence's earlier tokens (those before this step) into the pool, as the
    prefill steps that produced them would have: a prefill over the first ctx - q_len tokens."""
    prior = [s for s in seqs if s.ctx > s.q_len]
    if not prior:
        return
    lens = [s.ctx - s.q_len for s in prior]
    step = StepMetadata.build(lens, lens, [s.table for s in prior], block_size, DEVICE)
    attend(backend, torch.zeros(sum(lens), heads, prior[0].q.shape[-1]), torch.cat([s.k[: s.ctx - s.q_len] for s in prior]),
           torch.cat([s.v[: s.ctx - s.q_len] for s in prior]), step, 1.0)


def expected_pool(seqs: list[SeqData], k0: torch.Tensor, v0: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The garbage pool with exactly the written tokens placed where the tables say, by a loop."""
    k_exp, v_exp = k0.clone(), v0.clone()
    for s in seqs:
        for pos in range(s.ctx):
            block, off = s.table[pos // block_size], pos % block_size
            k_exp[block, off] = s.k[pos]
            v_exp[block, off] = s.v[pos]
    return k_exp, v_exp


def run_step(backend_name: str, shapes: list[tuple[int, int]], heads: int, kv_heads: int, block_size: int,
             seed: int = 0, scale: float | None = None, head_dim: int = HEAD_DIM) -> None:
    """Write context, then write the step's new tokens and attend; compare with the reference."""
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    seqs, k0, v0 = make_case(shapes, heads, kv_heads, block_size, seed, head_dim)
    k_cache, v_cache = k0.to(DEVICE, copy=True), v0.to(DEVICE, copy=True)
    backend = make_backend(backend_name, k_cache, v_cache, heads)

    write_context(backend, seqs, heads, block_size)
    step = StepMetadata.build([s.q_len for s in seqs], [s.ctx for s in seqs],
                              [s.table for s in seqs], block_size, DEVICE)
    # Positions (for RoPE) are the last q_len positions of each sequence, in batch order.
    assert step.positions.tolist() == [p for s in seqs for p in range(s.ctx - s.q_len, s.ctx)]
    out = attend(backend, torch.cat([s.q for s in seqs]), torch.cat([s.k[s.ctx - s.q_len:] for s in seqs]),
                 torch.cat([s.v[s.ctx - s.q_len:] for s in seqs]), step, scale)

    # Every token landed at table[pos // bs], offset pos % bs, and nothing else was touched.
    k_exp, v_exp = expected_pool(seqs, k0, v0, block_size)
    assert torch.equal(k_cache.cpu(), k_exp)
    assert torch.equal(v_cache.cpu(), v_exp)

    ref = torch.cat([dense_reference(s, heads, kv_heads, scale) for s in seqs])
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


HEAD_LAYOUTS = [pytest.param(4, 4, id="mha"), pytest.param(8, 2, id="gqa"),
                pytest.param(4, 1, id="mqa")]
BLOCK_SIZES = [1, 16, 128]

# (ctx, q_len) per sequence. Lengths straddle block boundaries for 16 and 128 on purpose.
PREFILL = [(7, 7), (1, 1), (17, 17), (130, 130), (33, 33)]
DECODE = [(5, 1), (129, 1), (300, 1), (16, 1), (17, 1)]
# Two prefills, two decodes with long context, and one chunk of 5 new tokens after 15 cached.
MIXED = [(40, 40), (257, 1), (3, 3), (64, 1), (20, 5)]
# Decodes past 512 keys, which the cpu kernel cuts into pieces of 512 and merges (513: one key
# over; 1300: a short last piece), beside one that stays whole and a prefill.
LONG_DECODE = [(1300, 1), (513, 1), (512, 1), (40, 40), (1100, 1)]
# A few new tokens past 512 keys (a speculative draft's verification): cut into pieces as a decode
# token is, up to 8 tokens (9 stays whole), each row seeing the keys up to its own position.
LONG_VERIFY = [(1300, 5), (600, 8), (513, 2), (700, 9), (40, 40)]


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("heads,kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("shapes", [pytest.param(PREFILL, id="prefill"),
                                    pytest.param(DECODE, id="decode"),
                                    pytest.param(MIXED, id="mixed"),
                                    pytest.param(LONG_DECODE, id="long-decode"),
                                    pytest.param(LONG_VERIFY, id="long-verify")])
def test_paged_matches_dense(backend: str, shapes: list[tuple[int, int]], block_size: int, heads: int,
                             kv_heads: int) -> None:
    if backend == "triton" and (shapes is LONG_DECODE or shapes is LONG_VERIFY):
        pytest.skip("~40 s a case in the Triton interpreter; its context split runs in the decode cases")
    run_step(backend, shapes, heads, kv_heads, block_size, seed=block_size * 31 + heads * 7 + kv_heads)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("shapes", [[(1, 1)], [(200, 200)], [(200, 1)], [(9, 9), (9, 9), (9, 9)],
                                    [(30, 4), (12, 4)]])
def test_unpadded_grid(backend: str, shapes: list[tuple[int, int]]) -> None:
    # Every sequence brings the same number of new tokens, so the query grid has no padding
    # rows (a batch of one, equal-length prefills, equal-length chunks after cached context).
    run_step(backend, shapes, heads=8, kv_heads=2, block_size=16, seed=5)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("head_dim", [40, 64, 80, 128])
def test_head_dims(backend: str, head_dim: int) -> None:
    # The cpu kernel keeps a head's accumulator in registers for some head sizes (64 is
    # SmolLM2's, 128 Llama's) and loops for others (80); 40 is not a multiple of its 16 lanes.
    run_step(backend, MIXED, heads=8, kv_heads=2, block_size=16, seed=head_dim, head_dim=head_dim)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_scale_is_honoured(backend: str) -> None:
    # A scale far from 1/sqrt(D) would expose an implementation that ignores the argument.
    run_step(backend, MIXED, heads=8, kv_heads=2, block_size=16, seed=9, scale=0.9)


def test_slot_mapping_hand_worked() -> None:
    # block_size 4. Sequence A: table [5, 2], prefill of 6 tokens -> positions 0..5 ->
    # slots 5*4+0..3 = 20..23, then 2*4+0..1 = 8, 9. Sequence B: table [7, 0, 3], 10 tokens
    # cached, 1 new token at position 9 -> block table[9 // 4] = 3, offset 1 -> slot 13.
    step = StepMetadata.build([6, 1], [6, 10], [[5, 2], [7, 0, 3]], block_size=4, device=CPU)
    assert step.slot_mapping.tolist() == [20, 21, 22, 23, 8, 9, 13]
    assert step.positions.tolist() == [0, 1, 2, 3, 4, 5, 9]
    assert step.query_start.tolist() == [0, 6, 7]
    assert step.max_query_len == 6
    assert step.block_tables.tolist() == [[5, 2, 0], [7, 0, 3]]
    # The reference backend's grid: max_query_len 6, so A's tokens take rows 0..5, B's row 6.
    meta = make_backend("torch", torch.zeros(8, 4, 1, 4), torch.zeros(8, 4, 1, 4), 1).prepare(step)
    assert meta.query_index.tolist() == [0, 1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_permuted_table_changes_result(backend: str) -> None:
    # Reading through a swapped table must change the output: proves paged_attention follows the
    # table rather than assuming an order. A prefill is used because its causal mask makes the
    # result depend on key order (a single query that sees every key would not).
    heads, kv_heads, bs = 4, 2, 4
    seqs, k_cache, v_cache = make_case([(8, 8)], heads, kv_heads, bs, seed=3)
    s = seqs[0]
    attn = make_backend(backend, k_cache.to(DEVICE), v_cache.to(DEVICE), heads)
    step = StepMetadata.build([8], [8], [s.table], bs, DEVICE)
    right = attend(attn, s.q, s.k, s.v, step, 0.5)
    # The same K/V written to the same slots again, but read through the reversed table.
    reversed_table = torch.tensor([s.table[::-1]], device=DEVICE)
    wrong = attend(attn, s.q, s.k, s.v, dataclasses.replace(step, block_tables=reversed_table), 0.5)
    torch.testing.assert_close(right, dense_reference(s, heads, kv_heads, 0.5), atol=ATOL, rtol=RTOL)
    assert not torch.allclose(right, wrong, atol=1e-3)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dim", [64, 80])
@pytest.mark.parametrize("kv_heads", [2, 4, 3])  # GQA groups of 4, 2 and 3 query heads (of 8, 8, 9)
def test_bf16_dense_pages_match_the_dense_reference(block_size: int, dim: int, kv_heads: int) -> None:
    """bf16 pages, which the cpu kernel's decode items read in place instead of decoding them
    first (64 through its register tiles, on AVX2 a group's rows accumulated 3, 2 or 1 at a time;
    80 through the plain loops); block 1 ends every 16-key tile early, so its padding must not
    read past the block."""
    heads, bf16 = 3 * kv_heads if kv_heads == 3 else 8, torch.bfloat16
    seqs, k0, v0 = make_case(MIXED, heads, kv_heads, block_size, seed=block_size, head_dim=dim)
    for s in seqs:
        s.q, s.k, s.v = (t.to(bf16).float() for t in (s.q, s.k, s.v))
    k_exp, v_exp = expected_pool(seqs, k0, v0, block_size)
    ref = torch.cat([dense_reference(s, heads, kv_heads, dim ** -0.5) for s in seqs])
    served = 0
    for name in BACKEND_NAMES:
        backend = make_backend(name, k_exp.to(DEVICE, bf16), v_exp.to(DEVICE, bf16), heads, missing_ok=True)
        if backend is None:
            continue
        served += 1
        step = StepMetadata.build([s.q_len for s in seqs], [s.ctx for s in seqs], [s.table for s in seqs],
                                  block_size, DEVICE)
        out = attend(backend, torch.cat([s.q for s in seqs]).to(bf16),
                     torch.cat([s.k[s.ctx - s.q_len:] for s in seqs]).to(bf16),
                     torch.cat([s.v[s.ctx - s.q_len:] for s in seqs]).to(bf16), step, dim ** -0.5)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    # The torch reference and at least one fast backend; on a GPU the fast one is Triton, which
    # takes power-of-two head dims only (64, 128 or 256 in the models users bring).
    assert served >= (1 if DEVICE.type == "cuda" and dim & (dim - 1) else 2)


@pytest.mark.parametrize("dim", [64, 80, 128])
@pytest.mark.parametrize("shapes", [pytest.param(DECODE, id="decode"),
                                    pytest.param([(300, 40), (129, 33), (70, 12)], id="prompt-chunks")])
def test_bf16_steps_round_the_exact_attention_once(shapes: list[tuple[int, int]], dim: int) -> None:
    """bf16 pages and a bf16 query: where the CPU has AVX512_BF16 and D is a multiple of 32, the
    cpu kernel scores keys and sums values with bf16 pair dot products (exact products, fp32 sums),
    the softmax weights rounded to bf16 first as HF's eager attention rounds its probabilities;
    fp32 products otherwise. A weight so rounded moves by at most 2^-9 of itself, which moves the
    output by at most 2^-9 of the attention of |v|; beyond that the output is the exact attention
    of the same bf16 values rounded once, within a bf16 step (2^-8 relative) of it, not the 2e-2
    the tests of mixed steps allow."""
    heads, kv_heads, bf16 = 9, 3, torch.bfloat16
    seqs, k0, v0 = make_case(shapes, heads, kv_heads, 16, seed=dim, head_dim=dim)
    for s in seqs:
        s.q, s.k, s.v = (t.to(bf16).float() for t in (s.q, s.k, s.v))
    k_exp, v_exp = expected_pool(seqs, k0, v0, 16)
    ref = torch.cat([dense_reference(s, heads, kv_heads, dim ** -0.5) for s in seqs]).double()
    rounded_weights = "avx512_bf16" in cpu_flags() and dim % 32 == 0
    of_abs = torch.cat([dense_reference(dataclasses.replace(s, v=s.v.abs()), heads, kv_heads, dim ** -0.5) for s in seqs])
    backend = make_backend("cpu", k_exp.to(bf16), v_exp.to(bf16), heads)
    step = StepMetadata.build([s.q_len for s in seqs], [s.ctx for s in seqs], [s.table for s in seqs], 16, CPU)
    out = attend(backend, torch.cat([s.q for s in seqs]).to(bf16),
                 torch.cat([s.k[s.ctx - s.q_len:] for s in seqs]).to(bf16),
                 torch.cat([s.v[s.ctx - s.q_len:] for s in seqs]).to(bf16), step, dim ** -0.5).double()
    bound = ref.abs() * 2 ** -8 + 1e-6 + (of_abs.double() * 2 ** -9 if rounded_weights else 0)
    assert ((out - ref).abs() <= bound).all(), ((out - ref).abs() - bound).max()


@pytest.mark.parametrize("window", [0, 58])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("dim", [64, 128])
def test_a_prompt_row_and_a_decode_get_the_same_bits(dim: int, block_size: int, window: int) -> None:
    """The cpu kernel reads a decode's few rows and a prompt chunk's many differently (in place
    against decoded blocks; bf16 values by pair dot products in groups of rows over the pairs any
    of them sees, a row's unseen keys at weight 0), in the same operations per row: each token of
    a 5-token chunk gets the output bits that token gets as a decode, so a verified draft, a chunk
    after a prefix-cache hit and a decode agree exactly (where neither is split across threads: a
    decode over more than 512 keys merges its pieces in another order). Block 5 puts a block's
    boundary inside the chunk and gives blocks an odd count of keys. Block 16 attends spans of 4
    blocks: the chunk ends inside one, and a window of 58 starts its rows' keys in two blocks of another,
    where the chunk's item starts a block earlier than a decode's."""
    heads, kv_heads, bf16, ctx = 9, 3, torch.bfloat16, 300
    seqs, k0, v0 = make_case([(ctx, 5)], heads, kv_heads, block_size, seed=dim, head_dim=dim)
    seq = seqs[0]
    k_exp, v_exp = expected_pool(seqs, k0, v0, block_size)
    backend = make_backend("cpu", k_exp.to(bf16), v_exp.to(bf16), heads)
    q, k, v = seq.q.to(bf16), seq.k.to(bf16), seq.v.to(bf16)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepMetadata) -> torch.Tensor:
        meta = backend.prepare(step)
        return backend.forward(0, q, k, v, backend.with_window(meta, window) if window else meta, dim ** -0.5)

    chunk = run(q, k[ctx - 5:], v[ctx - 5:], StepMetadata.build([5], [ctx], [seq.table], block_size, CPU))
    for i in range(5):
        at = ctx - 5 + i  # the token's position: a decode of it sees at + 1 keys
        decode = run(q[i:i + 1], k[at:at + 1], v[at:at + 1],
                     StepMetadata.build([1], [at + 1], [seq.table], block_size, CPU))
        assert torch.equal(chunk[i:i + 1], decode), i


def outputs_over_compressed_pages(fmt: str, heads: int, kv_heads: int, dtype: torch.dtype,
                                  keys: KVFormat | None = None) -> list[torch.Tensor]:
    """Each backend's output (the reference's first) for one mixed step over pages of `fmt` (keys:
    `keys` where given) that a prefill step wrote."""
    from kvserve.cache.quantized_pool import QuantizedKVPool

    seqs, _, _ = make_case(MIXED, heads, kv_heads, 16, seed=21)
    outs = []
    for name in BACKEND_NAMES:
        formats = keys or make_format(fmt, "k", group_size=16), make_format(fmt, "v", group_size=16)
        pool = QuantizedKVPool(64, 16, kv_heads, HEAD_DIM, dtype, CPU, [formats], 0, 0)
        if BACKENDS[name].unsupported(pool, CPU) is not None:  # e.g. triton not installed here
            continue
        backend = BACKENDS[name](pool, heads)
        plan = pool.write_plan(None)
        prior = [s for s in seqs if s.ctx > s.q_len]
        lens = [s.ctx - s.q_len for s in prior]
        backend.forward(0, torch.zeros(sum(lens), heads, HEAD_DIM, dtype=dtype),
                        torch.cat([s.k[:s.ctx - s.q_len] for s in prior]).to(dtype),
                        torch.cat([s.v[:s.ctx - s.q_len] for s in prior]).to(dtype),
                        backend.prepare(StepMetadata.build(lens, lens, [s.table for s in prior], 16, CPU, kv_plan=plan)),
                        1.0)
        step = StepMetadata.build([s.q_len for s in seqs], [s.ctx for s in seqs], [s.table for s in seqs], 16, CPU,
                                  kv_plan=plan)
        outs.append(backend.forward(0, torch.cat([s.q for s in seqs]).to(dtype),
                                    torch.cat([s.k[s.ctx - s.q_len:] for s in seqs]).to(dtype),
                                    torch.cat([s.v[s.ctx - s.q_len:] for s in seqs]).to(dtype),
                                    backend.prepare(step), HEAD_DIM ** -0.5).float())
    assert len(outs) >= 2  # the torch reference and at least one fast backend
    return outs


@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8_e4m3", "int4"])
def test_bf16_compressed_pages_match_the_reference_backend(fmt: str) -> None:
    """In bf16 the reference decodes codes into bf16 before attention; the cpu kernel attends over
    int8 / fp8 codes times their scales in fp32 (a token's scale on its score and weight), so it
    differs from it by that rounding of the decoded values as well."""
    outs = outputs_over_compressed_pages(fmt, 8, 2, torch.bfloat16)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kv_heads", [2, 3])  # GQA groups of 4 and 3 query heads (of 8 and 9)
@pytest.mark.parametrize("fmt", ["int8_fit", "fp8_e4m3_fit"])
def test_fitted_pages_match_the_reference_backend(fmt: str, kv_heads: int) -> None:
    """Fitted keys decode as codes x scale x spread + offset (the reference backend, through the
    format); the cpu kernel reads the codes x scale in place, the spread folded into the query and
    the offset left out (it moves every logit of a query alike): the same attention to fp32
    rounding of the shifted logits. Triton does not read them."""
    g = torch.Generator().manual_seed(30)
    offset = 3 * torch.randn(kv_heads, HEAD_DIM, generator=g)
    a = torch.randn(kv_heads, HEAD_DIM, HEAD_DIM, generator=g)
    spread = torch.rand(kv_heads, HEAD_DIM, generator=g) * 4 + 0.25
    keys = make_format(fmt, "k").calibrated(offset, a @ a.transpose(-1, -2) / HEAD_DIM, spread)
    assert (keys.layout.fit.spread is None) == (fmt == "fp8_e4m3_fit")
    outs = outputs_over_compressed_pages(fmt, 9 if kv_heads == 3 else 8, kv_heads, torch.float32, keys)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["int8_fit", "fp8_e4m3_fit"])
def test_fitted_pages_with_staging_go_to_the_reference_backend(fmt: str) -> None:
    """Staged keys are read as they are, with the offset and the spread in them, beside fitted
    codes read without: the cpu kernel refuses such a pool, and auto picks the torch backend, whose
    attention over staged and encoded keys matches the dense keys' to the codes' error."""
    from kvserve.attention.selector import make_backend
    from kvserve.cache.quantized_pool import QuantizedKVPool
    from kvserve.cache.staging_slots import StagingPlan

    kv_heads, heads, g = 2, 4, torch.Generator().manual_seed(31)
    k, v, q = (torch.randn(20, n, HEAD_DIM, generator=g) for n in (kv_heads, kv_heads, heads))
    k[..., 3] += 10
    a = torch.randn(kv_heads, HEAD_DIM, HEAD_DIM, generator=g)
    keys = make_format(fmt, "k").calibrated(k.mean(0), a @ a.transpose(-1, -2) / HEAD_DIM,
                                            (k - k.mean(0)).abs().amax(0))
    pool = QuantizedKVPool(8, 16, kv_heads, HEAD_DIM, torch.float32, CPU, [(keys, make_format(fmt, "v"))], 16, 4)
    assert "staging" in (BACKENDS["cpu"].unsupported(pool, CPU) or "")
    backend = make_backend("auto", pool, heads, CPU)
    assert backend.name == "torch"
    backend.forward(0, q[:16], k[:16], v[:16], backend.prepare(
        StepMetadata.build([16], [16], [[0, 1]], 16, CPU, kv_plan=pool.write_plan(None))), HEAD_DIM ** -0.5)
    plan = pool.write_plan(StagingPlan(staged=((0, 0, 4),), seals=(), reads=((1, 0),), copies=()))
    out = backend.forward(0, q[16:], k[16:], v[16:], backend.prepare(
        StepMetadata.build([4], [20], [[0, 1]], 16, CPU, kv_plan=plan)), HEAD_DIM ** -0.5)
    dense = F.scaled_dot_product_attention(q[16:].transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
                                           v.repeat_interleave(2, 1).transpose(0, 1), is_causal=False,
                                           attn_mask=torch.ones(4, 20, dtype=torch.bool).tril(16))
    torch.testing.assert_close(out, dense.transpose(0, 1), atol=0.05, rtol=0)


@pytest.mark.parametrize("kv_heads", [2, 4, 3])  # GQA groups of 4, 2 and 3 query heads (of 8, 8, 9)
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_absmax_pages_match_the_reference_backend(fmt: str, kv_heads: int) -> None:
    """Per-token scaled codes in fp32, which the cpu kernel's decode items read in place (int8) or
    decode unscaled (fp8), a token's scale applied to its score and weight, and on AVX2 a group's
    rows accumulated 3, 2 or 1 at a time: equal to the reference backend to fp32 rounding."""
    outs = outputs_over_compressed_pages(fmt, 9 if kv_heads == 3 else 8, kv_heads, torch.float32)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=ATOL, rtol=RTOL)
