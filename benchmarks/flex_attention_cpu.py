"""FlexAttention as a paged CPU attention candidate: `python benchmarks/flex_attention_cpu.py`.

The comparison issue 9 asked for before choosing the CPU backend's kernel. The pages of a
one-layer pool (SmolLM2's 9 heads / 3 KV heads, head_dim 64, block 16, bf16) are the keys
of one flat sequence; a mask_mod admits key j for query i when j's block belongs to i's
sequence and sits at or before i's position. `create_block_mask` with 16-key blocks (one per
page) lets the compiled kernel skip other sequences' pages. Prints mask build, first-call
(compile) and median call times; `kvserve bench attention` gives the cpu and torch backends'
times on the same shapes.
"""
from __future__ import annotations

import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
SHAPES = [("decode 1 x 256", 1, [256]), ("decode 32 x 256", 1, [256] * 32), ("prefill 4 x 256", 256, [256] * 4)]


def measure(q_len: int, ctxs: list[int], reps: int = 20) -> tuple[float, float, float]:
    gen = torch.Generator().manual_seed(0)
    blocks = [-(-c // BLOCK) for c in ctxs]
    total_blocks = sum(blocks)
    perm = torch.randperm(total_blocks, generator=gen)
    owner = torch.repeat_interleave(torch.arange(len(ctxs)), torch.tensor(blocks))[perm.argsort()]
    logical = torch.cat([torch.arange(n) for n in blocks])[perm.argsort()]
    k = torch.randn(1, KV_HEADS, total_blocks * BLOCK, DIM, generator=gen).bfloat16()
    v = torch.randn(1, KV_HEADS, total_blocks * BLOCK, DIM, generator=gen).bfloat16()
    tokens = q_len * len(ctxs)
    q = torch.randn(1, HEADS, tokens, DIM, generator=gen).bfloat16()
    seq_of = torch.arange(len(ctxs)).repeat_interleave(q_len)
    pos = torch.tensor(ctxs)[seq_of] - q_len + torch.arange(tokens) % q_len

    def mask_mod(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        page = ki // BLOCK
        return (owner[page] == seq_of[qi]) & (logical[page] * BLOCK + ki % BLOCK <= pos[qi])

    start = time.perf_counter()
    mask = create_block_mask(mask_mod, 1, None, tokens, total_blocks * BLOCK, device="cpu",
                             BLOCK_SIZE=(128 if tokens >= 128 else 16, BLOCK))
    mask_s = time.perf_counter() - start
    attend = torch.compile(flex_attention, dynamic=False)
    start = time.perf_counter()
    attend(q, k, v, block_mask=mask, enable_gqa=True)
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        attend(q, k, v, block_mask=mask, enable_gqa=True)
        times.append(time.perf_counter() - start)
    return mask_s, compile_s, sorted(times)[reps // 2]


if __name__ == "__main__":
    print("| step | block mask ms | first call s | call us |\n|---|---|---|---|")
    for name, q_len, ctxs in SHAPES:
        mask_s, compile_s, call_s = measure(q_len, ctxs)
        print(f"| {name} | {mask_s * 1e3:.1f} | {compile_s:.1f} | {call_s * 1e6:,.0f} |")
