"""Turns a batch of logits into next tokens: greedy, temperature, top-k, top-p, seeded.

Vectorized over the batch. A draw is an inverse-CDF sample (fp64 CDF) with one uniform per row
made from (seed, position) alone, with no generator per row, so a request's output does not
depend on its batch or on preemption.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from kvserve.device_copy import to_device
from kvserve.model.ops import EagerOps
from kvserve.sampling_params import SamplingParams


def draw_seed(seed: int, position: int) -> int:
    """A 63-bit key from (seed, position) alone: the same draw in any batch and after a
    preemption. Hashing keeps distinct pairs apart and takes any int seed."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int],
           argmax: Callable[[torch.Tensor], torch.Tensor] = EagerOps.argmax) -> torch.Tensor:
    """logits: [B, vocab] fp32. `positions[i]` is the index of the token being drawn; `argmax`: the
    model's ops' (model/ops.py; the runner's are the compiled kernels' on CPU)."""
    greedy = argmax(logits)
    if all(p.greedy for p in params):
        return greedy
    device = logits.device
    # Host lists go through to_device: a plain copy would wait for the step's forward to end.
    temperature = to_device(torch.tensor([p.scale_temperature for p in params]), device)
    logits = logits / temperature[:, None]
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        logits = _top_k_top_p(logits, params)
    probs = torch.softmax(logits, dim=-1)
    # Inverse-CDF sampling with one uniform per row, made from (seed, position) alone, so a
    # request draws the same token in any batch; the rows are drawn together, with no generator
    # per row. The CDF is fp64 and scaled to its own total, so rounding never reaches a token of
    # zero probability (right=True skips the flat steps of filtered tokens).
    keys = to_device(torch.tensor([draw_seed(seed, pos) >> 10 for seed, pos in zip(seeds, positions)],
                                  dtype=torch.float64), device)
    uniform = (keys + 0.5) / 2.0 ** 53
    cdf = probs.double().cumsum(dim=-1)
    sampled = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    sampled = sampled.clamp(max=logits.shape[1] - 1)
    is_greedy = to_device(torch.tensor([p.greedy for p in params]), device)
    return torch.where(is_greedy, greedy, sampled)


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[1]
    device = logits.device
    # Clamped: any top_k is valid, but one past int64 would not fit the tensor.
    top_k = to_device(torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]), device)
    top_p = to_device(torch.tensor([p.top_p for p in params]), device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    drop = ranks >= top_k[:, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    # Rows with top_p == 1 skip this: a dominant token's mass can round to exactly 1.0.
    drop |= ((sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]) & (top_p < 1)[:, None]
    drop[:, 0] = False  # a top_p below fp32's smallest number rounds to 0 and would drop it too
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
