"""Triton paged attention: one kernel for prefill, decode and mixed steps, pages read in place.

A program owns one query tile of one sequence (BLOCK_M new tokens x the GQA group of one KV
head, flattened to BLOCK_M * GROUP_P2 rows so the heads of a group share every K/V load) and
one split of that tile's keys. It walks the keys BLOCK_N at a time through the sequence's block
table, so any block size works and nothing is padded to the longest context of the batch.
Compressed pages are decoded in registers: int8 / fp8 codes times a per-token (or per-head) scale, packed
int4 / int2 codes with per-group (per token) or per-channel (per block, KIVI keys) scale and
zero-point; a block holding a full-precision staging slot is read from there instead.

Long contexts are split across programs (flash-decoding): each split writes its unnormalised
output with its running max and sum, and `_combine_splits` merges them.

A sliding window (`window` > 0) masks the keys before slot q - window + 1 of each query, and a
tile's keys start at its first row's first key: the blocks before it are never read, nor their
table entries (a hybrid KV cache points those at a null block).

Under TRITON_INTERPRET=1 the same kernels run on CPU tensors, which is how CI tests them.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.device_copy import to_device


@dataclass(frozen=True)
class PageSource:
    """Where one of K or V lives for one layer, and how to decode it (`kind`: DENSE 0, ABSMAX 1,
    GROUPED 2, CHANNEL 3, HEAD_ABSMAX 4, see kvserve/attention/page_kinds.py). Unused tensors point at `data`
    (the kernel never reads them, but needs a valid pointer)."""
    kind: int
    data: torch.Tensor          # [blocks, bs, kv_heads, D] values or codes ([..., D * bits / 8] packed)
    # ABSMAX [blocks, bs, kvh]; HEAD_ABSMAX [kvh] fp32; GROUPED [blocks, bs, kvh, D / group]; CHANNEL [blocks, kvh, D]
    scale: torch.Tensor
    zero: torch.Tensor          # like scale, GROUPED and CHANNEL only
    bits: int = 8
    group: int = 1
    sink: torch.Tensor | None = None  # CHANNEL with kv_exact_sink: each block's first key [blocks, kvh, D] fp16
    symmetric: bool = False  # GROUPED midrise codes: (code - 2^(bits-1) + 1/2) * scale, no zero-point
    # CHANNEL with wide channels: each token's extra bit plane [blocks, bs, kvh, wide / 8] and, per KV
    # head and channel, the channel's bit in it (-1: not wide) [kvh, D] int32.
    wide: torch.Tensor | None = None
    wide_slot: torch.Tensor | None = None


@triton.jit
def _load_pages(data, scale, zero, wide, wide_slot, tok, page, h, d, ok,
                KIND: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, SYM: tl.constexpr,
                WIDE: tl.constexpr, H: tl.constexpr, D: tl.constexpr):
    """[N, D] fp32 values of flat token slots `tok` (in blocks `page`), KV head h."""
    tok2 = tok[:, None]
    d2 = d[None, :]
    ok2 = ok[:, None]
    # Masked lanes are loaded without a fill value (fp8 has no literal 0 in every Triton
    # version) and zeroed once decoded: a garbage code times a scale could be NaN.
    if KIND == 0:
        x = tl.load(data + (tok2 * H + h) * D + d2, mask=ok2).to(tl.float32)
    elif KIND == 1:
        x = tl.load(data + (tok2 * H + h) * D + d2, mask=ok2).to(tl.float32)
        s = tl.load(scale + tok * H + h, mask=ok).to(tl.float32)
        x = x * s[:, None]
    elif KIND == 4:
        x = tl.load(data + (tok2 * H + h) * D + d2, mask=ok2).to(tl.float32) * tl.load(scale + h)
    else:
        PER: tl.constexpr = 8 // BITS
        byte = tl.load(data + (tok2 * H + h) * (D // PER) + d2 // PER, mask=ok2).to(tl.int32)
        code = (byte >> ((d2 % PER) * BITS)) & ((1 << BITS) - 1)
        if WIDE > 0:
            slot = tl.load(wide_slot + h * D + d)[None, :]
            has = ok2 & (slot >= 0)
            plane = tl.load(wide + (tok2 * H + h) * (WIDE // 8) + slot // 8, mask=has, other=0).to(tl.int32)
            code += ((plane >> (slot % 8)) & 1) << BITS
        code = code.to(tl.float32)
        if KIND == 2:
            at = (tok2 * H + h) * (D // GROUP) + d2 // GROUP
        else:
            at = (page[:, None] * H + h) * D + d2
        s = tl.load(scale + at, mask=ok2).to(tl.float32)
        if SYM:
            x = (code - ((1 << (BITS - 1)) - 0.5)) * s
        else:
            x = code * s + tl.load(zero + at, mask=ok2).to(tl.float32)
    return tl.where(ok2, x, 0.0)


@triton.jit
def _paged_attention(
        q, out, part_acc, part_ml,
        tile_seq, tile_q0, query_start, context_lens, tables, table_stride,
        k_data, k_scale, k_zero, v_data, v_scale, v_zero, k_sink, k_wide, k_slot, v_wide, v_slot,
        stage_of, k_stage, v_stage, sm_scale, total_tokens, reach,
        HEADS: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
        GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_SINK: tl.constexpr,
        K_SYM: tl.constexpr, K_WIDE: tl.constexpr,
        V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_SYM: tl.constexpr, V_WIDE: tl.constexpr,
        STAGED: tl.constexpr, SPLITS: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    b = tl.load(tile_seq + tile)
    q0 = tl.load(tile_q0 + tile)
    start = tl.load(query_start + b)
    q_len = tl.load(query_start + b + 1) - start
    ctx = tl.load(context_lens + b)

    BLOCK_R: tl.constexpr = BLOCK_M * GROUP_P2
    r = tl.arange(0, BLOCK_R)
    m = q0 + r // GROUP_P2
    g = r % GROUP_P2
    row_ok = (m < q_len) & (g < GROUP)
    head = h * GROUP + g
    row = start + m
    d = tl.arange(0, D)
    qv = tl.load(q + (row[:, None] * HEADS + head[:, None]) * D + d[None, :], mask=row_ok[:, None], other=0.0)
    if DOT_FP32:
        qv = qv.to(tl.float32)
    q_pos = ctx - q_len + m
    qk_scale = sm_scale * 1.4426950408889634  # exp2 instead of exp

    # The last row of the tile sees keys up to its own position; none sees past the context. A
    # row sees `reach` slots back, its own included: the window, or (none) past slot 0.
    kv_start = tl.maximum(ctx - q_len + q0 - reach + 1, 0)  # the first row's first key
    kv_end = tl.minimum(ctx, ctx - q_len + q0 + BLOCK_M)
    per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, SPLITS), BLOCK_N) * BLOCK_N
    lo = kv_start + split * per_split
    hi = tl.minimum(kv_end, lo + per_split)

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        key_ok = n < hi
        page = tl.load(tables + b * table_stride + n // BS, mask=key_ok, other=0)
        offset = n % BS
        tok = page * BS + offset
        kx = _load_pages(k_data, k_scale, k_zero, k_wide, k_slot, tok, page, h, d, key_ok,
                         K_KIND, K_BITS, K_GROUP, K_SYM, K_WIDE, H, D)
        vx = _load_pages(v_data, v_scale, v_zero, v_wide, v_slot, tok, page, h, d, key_ok,
                         V_KIND, V_BITS, V_GROUP, V_SYM, V_WIDE, H, D)
        if K_SINK:
            first = key_ok & (offset == 0)
            sink = tl.load(k_sink + ((page * H + h) * D)[:, None] + d[None, :], mask=first[:, None], other=0.0)
            kx = tl.where(first[:, None], sink.to(tl.float32), kx)
        if STAGED:
            stage = tl.load(stage_of + page, mask=key_ok, other=-1)
            staged = stage >= 0
            at = ((stage * BS + offset)[:, None] * H + h) * D + d[None, :]
            ks = tl.load(k_stage + at, mask=(key_ok & staged)[:, None], other=0.0).to(tl.float32)
            vs = tl.load(v_stage + at, mask=(key_ok & staged)[:, None], other=0.0).to(tl.float32)
            kx = tl.where(staged[:, None], ks, kx)
            vx = tl.where(staged[:, None], vs, vx)
        s = tl.dot(qv, tl.trans(kx.to(qv.dtype)), input_precision=PRECISION) * qk_scale
        visible = key_ok[None, :] & (n[None, :] <= q_pos[:, None]) & (n[None, :] > q_pos[:, None] - reach)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps -inf; subtracting 0 keeps exp2 at 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(qv.dtype), vx.to(qv.dtype), input_precision=PRECISION)
        m_i = m_new

    at = (row[:, None] * HEADS + head[:, None]) * D + d[None, :]
    if SPLITS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out + at, o.to(out.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(part_acc + split * total_tokens * HEADS * D + at, acc, mask=row_ok[:, None])
        ml = (split * total_tokens * HEADS + row * HEADS + head) * 2
        tl.store(part_ml + ml, m_i, mask=row_ok)
        tl.store(part_ml + ml + 1, l_i, mask=row_ok)


@triton.jit
def _combine_splits(out, part_acc, part_ml, rows, D: tl.constexpr, SPLITS: tl.constexpr,
                    SPLITS_P2: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """BLOCK_ROWS (token, head) rows: merge the splits' partial softmaxes at a common max."""
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    s = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, D)
    row_ok = row < rows
    ok = (s[:, None] < SPLITS) & row_ok[None, :]
    ml = (s[:, None] * rows + row[None, :]) * 2
    m_s = tl.load(part_ml + ml, mask=ok, other=float("-inf"))  # [splits, rows]
    l_s = tl.load(part_ml + ml + 1, mask=ok, other=0.0)
    m_max = tl.max(m_s, 0)  # some split holds a real row's own key: finite
    m_max = tl.where(row_ok, m_max, 0.0)
    w = tl.where(m_s > float("-inf"), tl.exp2(m_s - m_max[None, :]), 0.0)
    at = (s[:, None, None] * rows + row[None, :, None]) * D + d[None, None, :]
    acc = tl.load(part_acc + at, mask=ok[:, :, None], other=0.0)  # [splits, rows, D]
    denom = tl.where(row_ok, tl.sum(l_s * w, 0), 1.0)
    o = tl.sum(acc * w[:, :, None], 0) / denom[:, None]
    tl.store(out + row[:, None] * D + d[None, :], o.to(out.dtype.element_ty), mask=row_ok[:, None])


@dataclass(frozen=True)
class Tiles:
    """A step's query tiles: program i serves rows tile_q0[i] .. + block_m of sequence tile_seq[i]."""
    tile_seq: torch.Tensor     # [tiles] int32, on the device
    tile_q0: torch.Tensor      # [tiles] int32
    query_start: torch.Tensor  # [B + 1] int32, on the device
    context_lens: torch.Tensor  # [B] int32
    tables: torch.Tensor       # [B, max_blocks] int32
    block_m: int
    splits: int


# The interpreter's tl.dot misreads bf16 / fp16 operands (as raw bits): it multiplies in fp32.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Enough programs to fill a large GPU several times over before splitting contexts further.
TARGET_PROGRAMS = 512
SPLIT_MIN_KEYS = 256
COMBINE_ROWS = 32
# The reach of a query without a window: past slot 0 from any slot, and slot - reach fits int32.
NO_WINDOW = 1 << 30


def _block_n(dim: int) -> int:
    """Keys per loop step: 64, or 32 past head_dim 128, so a step's K and V tiles (fp32 when the
    queries are) stay within shared memory at head_dim 256."""
    return 64 if dim <= 128 else 32


def plan_tiles(query_start: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
               max_query_len: int, group: int, kv_heads: int) -> Tiles:
    """Tile sizes and the tile -> sequence map, built once per step on the CPU (vectorized)."""
    group_p2 = triton.next_power_of_2(group)
    rows = 16 if max_query_len == 1 else 64  # tl.dot needs at least 16 rows
    block_m = max(1, rows // group_p2)
    q_lens = query_start.diff()
    n_tiles = (q_lens + block_m - 1) // block_m
    total = int(n_tiles.sum())
    tile_seq = torch.repeat_interleave(torch.arange(len(q_lens)), n_tiles, output_size=total)
    first = torch.cumsum(n_tiles, 0) - n_tiles
    tile_q0 = (torch.arange(total) - first[tile_seq]) * block_m
    splits = _splits(int(context_lens.max()), total, kv_heads)
    device = block_tables.device
    i32 = torch.int32
    return Tiles(to_device(tile_seq, device, i32), to_device(tile_q0, device, i32), to_device(query_start, device, i32),
                 to_device(context_lens, device, i32), block_tables.to(i32), block_m, splits)


def decode_tiles(context_lens: torch.Tensor, tables: torch.Tensor, max_context: int, group: int,
                 kv_heads: int) -> Tiles:
    """The tiles of a decode step of len(context_lens) sequences (one token each) whose tensors
    are `context_lens` [B] and `tables` [B, max_blocks] themselves (int32, on the device), so a
    CUDA graph captured over them serves any contexts written there before a replay. The split
    count is fixed by `max_context`: splits past a shorter context find no keys and add nothing."""
    batch = context_lens.shape[0]
    device, i32 = tables.device, torch.int32
    block_m = max(1, 16 // triton.next_power_of_2(group))
    return Tiles(torch.arange(batch, dtype=i32, device=device), torch.zeros(batch, dtype=i32, device=device),
                 torch.arange(batch + 1, dtype=i32, device=device), context_lens, tables, block_m,
                 _splits(max_context, batch, kv_heads))


def window_tiles(tiles: Tiles, window: int, kv_heads: int) -> Tiles:
    """`tiles` for a layer whose queries see their last `window` slots: a tile reads at most
    window - 1 + block_m keys, so fewer splits may cover it (a choice from sizes alone, as a CUDA
    graph needs)."""
    splits = min(tiles.splits, _splits(window - 1 + tiles.block_m, tiles.tile_seq.shape[0], kv_heads))
    return dataclasses.replace(tiles, splits=splits)


def _splits(max_context: int, tiles: int, kv_heads: int) -> int:
    return max(1, min(-(-max_context // SPLIT_MIN_KEYS), TARGET_PROGRAMS // max(1, tiles * kv_heads)))


def _wide_args(src: PageSource) -> tuple[torch.Tensor, torch.Tensor]:
    return (src.data, src.data) if src.wide is None else (src.wide, src.wide_slot)


def _wide_bits(src: PageSource) -> int:
    return 0 if src.wide is None else src.wide.shape[-1] * 8


def paged_attention(q: torch.Tensor, tiles: Tiles, k: PageSource, v: PageSource,
                    stage_of: torch.Tensor | None, k_stage: torch.Tensor | None, v_stage: torch.Tensor | None,
                    scale: float, block_size: int, kv_heads: int, window: int = 0) -> torch.Tensor:
    """q [T, heads, D] contiguous -> attention over each sequence's pages, [T, heads, D]; each query
    sees its last `window` slots only (0 or -1: all up to its own)."""
    total, heads, dim = q.shape
    group = heads // kv_heads
    out = torch.empty_like(q)
    splits = tiles.splits
    if splits > 1:
        part_acc = torch.empty((splits, total, heads, dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((splits, total, heads, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out
    staged = stage_of is not None
    grid = (tiles.tile_seq.shape[0], kv_heads, splits)
    _paged_attention[grid](
        q, out, part_acc, part_ml, tiles.tile_seq, tiles.tile_q0, tiles.query_start, tiles.context_lens,
        tiles.tables, tiles.tables.stride(0),
        k.data, k.scale, k.zero, v.data, v.scale, v.zero, k.data if k.sink is None else k.sink,
        *_wide_args(k), *_wide_args(v),
        stage_of if staged else tiles.tables, k_stage if staged else q, v_stage if staged else q,
        scale, total, window if window > 0 else NO_WINDOW,
        HEADS=heads, H=kv_heads, D=dim, BS=block_size, GROUP=group, GROUP_P2=triton.next_power_of_2(group),
        BLOCK_M=tiles.block_m, BLOCK_N=_block_n(dim),
        K_KIND=k.kind, K_BITS=k.bits, K_GROUP=k.group, K_SINK=k.sink is not None, K_SYM=k.symmetric,
        K_WIDE=_wide_bits(k), V_KIND=v.kind, V_BITS=v.bits, V_GROUP=v.group, V_SYM=v.symmetric, V_WIDE=_wide_bits(v),
        STAGED=staged, SPLITS=splits, DOT_FP32=q.dtype == torch.float32 or INTERPRETED,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    if splits > 1:
        rows = total * heads
        _combine_splits[(triton.cdiv(rows, COMBINE_ROWS),)](
            out, part_acc, part_ml, rows, D=dim, SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits),
            BLOCK_ROWS=COMBINE_ROWS)
    return out
