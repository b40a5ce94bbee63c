"""Log-probabilities of the tokens a step produced, for requests that ask (`SamplingParams.logprobs`)."""
from __future__ import annotations

import torch

from kvserve.engine.sequence import TokenLogprobs
from kvserve.sampling_params import SamplingParams


def token_logprobs(logits: torch.Tensor, params: list[SamplingParams],
                   tokens: list[int]) -> list[TokenLogprobs | None]:
    """logits [B, vocab] of the rows `tokens` were drawn from; None for rows that did not ask.
    One log-softmax over the asking rows together, then one top-k at the largest k asked."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return out
    device = logits.device
    temperature = torch.tensor([params[i].temperature or 1.0 for i in rows], device=device)
    logp = torch.log_softmax(logits[rows].float() / temperature[:, None], dim=-1)
    chosen = logp.gather(1, torch.tensor([tokens[i] for i in rows], device=device)[:, None]).squeeze(1).tolist()
    k = max(params[i].logprobs for i in rows)
    top_v, top_i = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    for j, i in enumerate(rows):
        n = params[i].logprobs
        top = dict(zip(top_i[j][:n], top_v[j][:n])) if n > 0 else {}
        out[i] = TokenLogprobs(tokens[i], chosen[j], top, logp[j].cpu() if n == -1 else None)
    return out
