"""The attention a step's queries give each cached slot, for the eviction policies that rank
tokens by it (H2O, SnapKV, TOVA).

Backends return attention outputs, not weights; the weights are recomputed here, in plain
torch, for the scored sequences only and only from the query rows their policy counts: the
keys are read through the layer's pages (decoded if compressed) after the backend wrote the
step's own. Costs one gather of the scored sequences' keys per layer.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.attention.metadata import StepMetadata


@dataclass(frozen=True)
class ScorePlan:
    """Scored sequence i is batch sequence `batch_index[i]`; its counted query rows are
    `rows[i, :count_i]` of the step's [T] queries (padded with its last one, weight 0)."""
    batch_index: list[int]
    step: StepMetadata          # the scored sequences' block tables and context lengths
    rows: torch.Tensor          # [n, R] row of the step's queries
    weight: torch.Tensor        # [n, R] fp32: 1 for a counted row, 0 for padding
    visible: torch.Tensor       # [n, R, S] bool: the slots each row's query sees (causal, in its context)
    max_slots: int              # S: the longest scored context
    first_row: torch.Tensor     # [B] int64: each batch sequence's first counted query row, -1 if not scored

    @classmethod
    def build(cls, step: StepMetadata, first_rows: dict[int, int]) -> "ScorePlan":
        """`first_rows`: batch index -> the first of its query rows that counts (its last row
        always does)."""
        index = sorted(first_rows)
        q_lens = step.query_start.diff()
        counts = [int(q_lens[b]) - min(first_rows[b], int(q_lens[b]) - 1) for b in index]
        width = max(counts)
        j = torch.arange(width)
        rows, slots, weight = [], [], []
        for b, count in zip(index, counts):
            offset = torch.clamp(j, max=count - 1) + int(q_lens[b]) - count  # within the query
            rows.append(int(step.query_start[b]) + offset)
            slots.append(int(step.context_lens[b]) - int(q_lens[b]) + offset)
            weight.append((j < count).float())
        device = step.block_tables.device
        pick = torch.tensor(index)
        ctx = step.context_lens[pick]
        sub = dataclasses.replace(step, query_start=torch.zeros(len(index) + 1, dtype=torch.long),
                                  context_lens=ctx, block_tables=step.block_tables[pick.to(device)])
        # The same for every layer: built once per step.
        s = torch.arange(int(ctx.max()))
        visible = (s <= torch.stack(slots)[..., None]) & (s < ctx[:, None, None])
        first_row = torch.full((len(q_lens),), -1, dtype=torch.long)
        first_row[pick] = q_lens[pick].cpu() - torch.tensor(counts)
        return cls(index, sub, torch.stack(rows).to(device), torch.stack(weight).to(device), visible.to(device),
                   int(ctx.max()), first_row)


def slot_scores(kv: Any, q: torch.Tensor, plan: ScorePlan, scale: float, softcap: float | None = None) -> torch.Tensor:
    """Attention probability each scored sequence's slots receive from its counted queries,
    summed over those queries and averaged over the query heads of each KV head:
    [n, kv_heads, max_slots] fp32 (0 past a sequence's context)."""
    k_pages, _ = kv.gather(plan.step)
    slots = plan.max_slots
    keys = k_pages.flatten(1, 2)[:, :slots].float()              # [n, S, kvh, D]
    n, _, kv_heads, dim = keys.shape
    queries = q[plan.rows].float()                                 # [n, R, heads, D]
    group = queries.shape[2] // kv_heads
    queries = queries.view(n, -1, kv_heads, group, dim)
    logits = torch.einsum("nrkgd,nskd->nkgrs", queries, keys) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    probs = logits.masked_fill(~plan.visible[:, None, None], float("-inf")).softmax(-1)
    return (probs * plan.weight[:, None, None, :, None]).sum(3).mean(2)
