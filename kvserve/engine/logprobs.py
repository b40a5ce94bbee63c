"""Log-probabilities for requests that ask: of the tokens a step produced (`SamplingParams.logprobs`)
and of the prompt's own tokens (`prompt_logprobs`)."""
from __future__ import annotations

import torch

from kvserve.engine.sequence import Sequence, TokenLogprobs


def token_logprobs(logits: torch.Tensor, ks: list[int | None], temperatures: list[float],
                   tokens: list[int]) -> list[TokenLogprobs | None]:
    """logits [R, vocab], the row each token of `tokens` was drawn from (or predicted by); row i
    asks for the top ks[i] (-1: everything; None: nothing, giving None) at temperatures[i]
    (SamplingParams.scale_temperature: greedy counts as 1). One log-softmax over the asking rows
    together, one top-k at the largest k."""
    rows = [i for i, k in enumerate(ks) if k is not None]
    out: list[TokenLogprobs | None] = [None] * len(ks)
    if not rows:
        return out
    device = logits.device
    temperature = torch.tensor([temperatures[i] for i in rows], device=device)
    logp = torch.log_softmax(logits[rows].float() / temperature[:, None], dim=-1)
    chosen = logp.gather(1, torch.tensor([tokens[i] for i in rows], device=device)[:, None]).squeeze(1).tolist()
    top_k = max(ks[i] for i in rows)  # type: ignore[type-var]
    if top_k == -1:
        top_k = 0
    top_v, top_i = logp.topk(top_k, dim=-1) if top_k > 0 else (logp[:, :0], logp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    for j, i in enumerate(rows):
        n = ks[i]
        top = dict(zip(top_i[j][:n], top_v[j][:n])) if n > 0 else {}  # type: ignore[operator]
        out[i] = TokenLogprobs(tokens[i], chosen[j], top, logp[j].cpu() if n == -1 else None)
    return out


def prompt_span(seq: Sequence, start: int, end: int) -> tuple[int, int]:
    """Positions [lo, hi) among the step's [start, end) whose logits score prompt tokens lo + 1 ..
    hi that the sequence has not scored yet (a recomputed prompt is not scored twice)."""
    if seq.params.prompt_logprobs is None:
        return start, start
    lo = max(start, len(seq.out.prompt_logprobs) - 1)  # the list starts as [None] (token 0)
    hi = min(end, len(seq.prompt_token_ids) - 1)
    return lo, max(lo, hi)
