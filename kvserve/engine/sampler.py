"""Turns a batch of logits into next tokens: greedy, temperature, top-k, top-p, seeded."""
from __future__ import annotations

import hashlib

import torch

from kvserve.sampling_params import SamplingParams



def draw_seed(seed: int, position: int) -> int:
    """Each draw depends only on (seed, position): the same in any batch and after a preemption.
    Hashing keeps distinct pairs apart and any int seed in the generator's range."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
           positions: list[int]) -> torch.Tensor:
    """logits: [B, vocab] fp32. `positions[i]` is the index of the token being drawn."""
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy
    device = logits.device
    temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
    logits = logits / temperature[:, None]
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        logits = _top_k_top_p(logits, params)
    probs = torch.softmax(logits, dim=-1)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p exactly.
    noise = torch.stack([
        torch.empty(logits.shape[1]).exponential_(
            generator=torch.Generator().manual_seed(draw_seed(seed, pos)))
        for seed, pos in zip(seeds, positions)]).to(device)
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = torch.tensor([p.greedy for p in params], device=device)
    return torch.where(is_greedy, greedy, sampled)


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[1]
    device = logits.device
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    drop = ranks >= top_k[:, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    # Rows with top_p == 1 skip this: a dominant token's mass can round to exactly 1.0.
    drop |= ((sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]) & (top_p < 1)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
