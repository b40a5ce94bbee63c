"""Presence, frequency and repetition penalties and logit bias: the logits a request samples from.

OpenAI's presence / frequency penalties count the tokens generated so far (a token's logit drops
by presence_penalty once it has appeared and by frequency_penalty per appearance); HF's
repetition_penalty covers prompt and output (positive logits divided by it, negative ones
multiplied); logit_bias adds to chosen tokens. Applied to every row that asks, together, with one
count tensor built for the step; rows that ask nothing are left untouched.
"""
from __future__ import annotations

import torch

from kvserve.sampling_params import GREEDY_BELOW, SamplingParams

LOGIT_BOUND = torch.finfo(torch.float32).max * GREEDY_BELOW / 4


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
                    outputs: list[list[int]]) -> torch.Tensor:
    """logits [B, vocab] fp32 -> the same with each row's penalties applied (a new tensor)."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[1]
    sub = logits[rows].float()

    def counts(lists: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(t) for t in lists))
        ids = torch.tensor([t + [0] * (width - len(t)) for t in lists], device=device)
        weight = torch.tensor([[1.0] * len(t) + [0.0] * (width - len(t)) for t in lists], device=device)
        return torch.zeros(len(lists), vocab, device=device).scatter_add_(1, ids, weight)

    def column(name: str) -> torch.Tensor:
        return torch.tensor([float(getattr(params[i], name)) for i in rows], device=device)[:, None]

    out_counts = counts([outputs[i] for i in rows])
    sub = sub - column("frequency_penalty") * out_counts - column("presence_penalty") * (out_counts > 0)
    # Extreme penalties must not round to 0 or inf in fp32 (0 * inf is NaN).
    repetition = column("repetition_penalty").clamp(1e-30, 1e30)
    if (repetition != 1).any():
        seen = (out_counts + counts([prompts[i] for i in rows])) > 0
        sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
        # A tiny penalty sends logits to inf and softmax to NaN; this bound keeps them finite
        # even after the smallest sampling temperature divides them.
        sub = sub.clamp(-LOGIT_BOUND, LOGIT_BOUND)
    for j, i in enumerate(rows):  # a handful of entries per request, set in one indexed add
        if params[i].logit_bias:
            ids = torch.tensor(list(params[i].logit_bias), device=device)
            sub[j].index_add_(0, ids, torch.tensor(list(params[i].logit_bias.values()), device=device))
    out = logits.clone()
    out[rows] = sub
    return out
