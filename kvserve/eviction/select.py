"""Which cached tokens a policy keeps: a mask over a sequence's slots, per layer and KV head.

Every function takes the positions each slot holds [L, H, S] (slots are not in position order
once eviction has filled holes) and, for the scored policies, the attention each slot received
[L, H, S], and keeps the same number of slots in every (layer, head) row, so the compacted
sequence has one length.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.eviction.policy import EvictionPolicy


def top(allowed: torch.Tensor, values: torch.Tensor, k: int) -> torch.Tensor:
    """Mask of the k largest `values` among `allowed` slots, per row (k <= allowed per row)."""
    ranked = values.to(torch.float64).masked_fill(~allowed, float("-inf"))
    out = torch.zeros_like(allowed)
    if k > 0:
        out.scatter_(-1, ranked.topk(k, dim=-1).indices, True)
    return out


def pooled(scores: torch.Tensor, positions: torch.Tensor, kernel: int) -> torch.Tensor:
    """SnapKV's smoothing: an average over `kernel` neighbouring positions (as kvpress pools),
    done in position order and put back in slot order."""
    order = positions.argsort(dim=-1)
    in_order = scores.gather(-1, order)
    smooth = F.avg_pool1d(in_order.reshape(-1, 1, in_order.shape[-1]), kernel, stride=1,
                          padding=kernel // 2).view_as(in_order)
    return torch.empty_like(smooth).scatter_(-1, order, smooth)


def kept(policy: EvictionPolicy, positions: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
    """The slots `policy` keeps out of the `positions.shape[-1]` > budget it holds [L, H, S] bool."""
    everything = torch.ones_like(positions, dtype=torch.bool)
    if policy.name == "window":
        sinks = positions < policy.sink_tokens
        return sinks | top(~sinks, positions, policy.budget - int(sinks[0, 0].sum()))
    if policy.name == "strided":
        sinks = positions < policy.sink_tokens
        recent = top(~sinks, positions, policy.recent)
        aligned = ~sinks & ~recent & (positions % policy.stride == 0)
        room = policy.budget - int(sinks[0, 0].sum()) - policy.recent
        return sinks | recent | top(aligned, positions, min(room, int(aligned.sum(-1).min())))
    assert scores is not None, f"{policy.name} ranks by attention scores"
    if policy.mean_heads:
        # Heads hold the same positions slot for slot here: every compaction moved them alike.
        scores = scores.mean(dim=1, keepdim=True).expand_as(scores)
    if policy.name == "tova":
        return top(everything, scores, policy.budget)
    if policy.name == "h2o":
        recent = top(everything, positions, policy.recent)
        # Mass over the queries that could see each token (kvpress' ObservedAttention): a plain
        # sum would favour old tokens for having been seen longer.
        seen = positions.max(dim=-1, keepdim=True).values + 1 - positions
        return recent | top(~recent, scores / seen, policy.budget - policy.recent)
    if policy.name == "snapkv":
        recent = top(everything, positions, policy.observation_window)
        # Pooled over the older tokens only (the window's own scores count as padding), as kvpress does.
        ranked = pooled(scores.masked_fill(recent, 0), positions, policy.pooling_kernel)
        return recent | top(~recent, ranked, policy.budget - policy.observation_window)
    raise ValueError(f"kv_eviction: no selection for {policy.name!r}")
