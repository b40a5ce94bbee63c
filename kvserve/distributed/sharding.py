"""Which heads and MLP columns each tensor-parallel rank holds, and its slice of the weights.

Attention splits by KV head, each rank keeping the query heads of its KV heads, so a rank's
pages hold only its KV heads. KV heads that do not divide evenly go to the first ranks (3 KV
heads over 2 ranks: 2 and 1). With fewer KV heads than ranks, each KV head is replicated on the
ranks that share its query heads (MQA over 2 ranks: both hold the one KV head, each half of the
queries). The MLP splits its intermediate columns. q/k/v and gate/up are column-parallel (each
rank computes its own outputs); o_proj and down_proj are row-parallel: each rank's partial sum is
all-reduced (`RowParallelLinear`). Embeddings, norms and the LM head are replicated.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from kvserve.model.config import ModelConfig
from kvserve.model.llama import LlamaForCausalLM


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int
    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    mlp: tuple[int, int]  # [start, end) of the intermediate columns
    replicated_kv: bool   # this rank's KV heads are also held by other ranks


def _split(n: int, parts: int, index: int) -> tuple[int, int]:
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def shard_of(cfg: ModelConfig, rank: int, world: int) -> Shard:
    group = cfg.num_heads // cfg.num_kv_heads
    if cfg.num_kv_heads >= world:
        lo, hi = _split(cfg.num_kv_heads, world, rank)
        kv = tuple(range(lo, hi))
        q = tuple(h for k in kv for h in range(k * group, (k + 1) * group))
        replicated = False
    else:
        if world % cfg.num_kv_heads or group % (world // cfg.num_kv_heads):
            raise ValueError(f"EngineConfig.tensor_parallel_size: {world} ranks cannot share {cfg.num_kv_heads} KV "
                             f"heads of {group} query heads each evenly")
        sharing = world // cfg.num_kv_heads
        k = rank // sharing
        lo, hi = _split(group, sharing, rank % sharing)
        kv, q, replicated = (k,), tuple(range(k * group + lo, k * group + hi)), True
    if cfg.intermediate_size < world:
        raise ValueError(f"EngineConfig.tensor_parallel_size: {world} ranks exceed the MLP's "
                         f"{cfg.intermediate_size} columns")
    return Shard(rank, world, q, kv, _split(cfg.intermediate_size, world, rank), replicated)


def shard_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    return replace(cfg, num_heads=len(shard.q_heads), num_kv_heads=len(shard.kv_heads),
                   intermediate_size=shard.mlp[1] - shard.mlp[0])


class RowParallelLinear(nn.Module):
    """A linear over this rank's slice of the input features; the ranks' outputs summed."""

    def __init__(self, linear: nn.Module, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        self.group.allreduce([out]).wait()
        return out


def _rows(w: torch.Tensor, heads: tuple[int, ...], head_dim: int, offset: int = 0) -> torch.Tensor:
    index = torch.tensor([offset + h * head_dim + d for h in heads for d in range(head_dim)])
    return w.index_select(0, index)


def shard_model(model: LlamaForCausalLM, shard: Shard, group: dist.ProcessGroup) -> LlamaForCausalLM:
    """A new model holding `shard`'s slice of `model`'s weights, o_proj and down_proj reduced over `group`."""
    cfg = model.config
    d, q_size = cfg.head_dim, cfg.num_heads * cfg.head_dim
    kv_size = cfg.num_kv_heads * d
    lo, hi = shard.mlp
    inter = cfg.intermediate_size
    state = {}
    for name, t in model.state_dict().items():
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            t = torch.cat([_rows(t, shard.q_heads, d), _rows(t, shard.kv_heads, d, q_size),
                           _rows(t, shard.kv_heads, d, q_size + kv_size)])
        elif name.endswith("o_proj.weight"):
            t = _rows(t.T, shard.q_heads, d).T
        elif name.endswith("gate_up_proj.weight"):
            t = torch.cat([t[lo:hi], t[inter + lo:inter + hi]])
        elif name.endswith("down_proj.weight"):
            t = t[:, lo:hi]
        state[name] = t.contiguous()
    part = LlamaForCausalLM(shard_config(cfg, shard)).to(dtype=next(model.parameters()).dtype)
    part.load_state_dict(state)
    part.model.rotary = model.model.rotary
    for layer in part.model.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, group)
    return part.to(next(model.parameters()).device).eval()
