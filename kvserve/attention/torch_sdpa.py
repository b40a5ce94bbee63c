"""The reference backend: pages gathered into dense padded tensors, one SDPA call per layer.

Queries are padded into a [batch, max_query_len] grid, each sequence's pages are gathered
through its block table (decoded if compressed) and padded to the longest context of the step,
and a causal + length mask does the rest (and a sliding layer's window: `with_window`). Simple,
any device, every KV format: the backend the tests hold the fast ones to. The one backend that
caps attention logits (Gemma 2): then the softmax is spelled out, as transformers' eager
attention does, since SDPA has no cap.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.attention.backend import AttentionBackend, Pool
from kvserve.attention.metadata import StepMetadata


@dataclass(frozen=True)
class SDPAMetadata:
    step: StepMetadata
    query_index: torch.Tensor | None  # [T] row of each new token in the [B * max_query_len] grid;
                                      # None when every sequence brings max_query_len tokens
    mask: torch.Tensor                # [B, 1, max_query_len * group, max_blocks * block_size] bool
    query_slots: torch.Tensor         # [B, max_query_len * group, 1] each grid row's slot, on the CPU


class TorchSDPABackend(AttentionBackend[SDPAMetadata]):
    name = "torch"
    masks_window = True
    caps_logits = True

    @classmethod
    def unsupported(cls, pool: Pool, device: torch.device) -> str | None:
        return None

    def prepare(self, step: StepMetadata) -> SDPAMetadata:
        batch, max_q = step.num_seqs, step.max_query_len
        group = self.num_heads // self.pool.num_kv_heads
        q_lens = step.query_start.diff()
        total = int(step.query_start[-1])
        offsets = torch.arange(total) - torch.repeat_interleave(step.query_start[:-1], q_lens, output_size=total)
        query_index = torch.repeat_interleave(torch.arange(batch) * max_q, q_lens, output_size=total) + offsets
        seq_of = torch.repeat_interleave(torch.arange(batch), q_lens, output_size=total)
        # A query sees the slots up to its own (slot ctx - q_len + j; not its position, which
        # counts evicted tokens). Padded rows keep slot 0: they attend to one key, never none (NaN).
        q_pos = torch.zeros(batch * max_q, dtype=torch.long)
        q_pos[query_index] = (step.context_lens - q_lens)[seq_of] + offsets
        q_pos = q_pos.view(batch, max_q, 1).repeat_interleave(group, dim=1)
        k_pos = torch.arange(step.block_tables.shape[1] * self.pool.block_size)
        mask = (k_pos <= q_pos) & (k_pos < step.context_lens[:, None, None])
        device = step.block_tables.device
        padded = total != batch * max_q
        return SDPAMetadata(step, query_index.to(device) if padded else None, mask.unsqueeze(1).to(device), q_pos)

    def with_window(self, meta: SDPAMetadata, window: int) -> SDPAMetadata:
        """The causal mask cut to keys after slot q - window, as transformers' sliding_window_overlay
        (kv_idx > q_idx - window). A padded row keeps slot 0, so it still sees one key."""
        if meta.step.evicts:
            raise ValueError(f"kv_eviction: a sliding window (of {window} positions) cannot mask a sequence that "
                             f"has evicted tokens: its slots no longer sit at their positions")
        k_pos = torch.arange(meta.mask.shape[-1])
        near = (k_pos > meta.query_slots - window).unsqueeze(1)
        return dataclasses.replace(meta, mask=meta.mask & near.to(meta.mask.device))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SDPAMetadata,
                scale: float) -> torch.Tensor:
        kv = self.pool.kv[layer]
        kv.write(k, v, meta.step)
        total, heads, dim = q.shape
        # [B, max_blocks, block_size, kvh, D]: the pages of the block tables, decoded if compressed.
        k_pages, v_pages = kv.gather(meta.step)
        kv_heads = k_pages.shape[3]
        group = heads // kv_heads
        batch, max_q = meta.step.num_seqs, meta.step.max_query_len

        if meta.query_index is None:
            grid = q
        else:
            grid = q.new_zeros(batch * max_q, heads, dim)
            grid[meta.query_index] = q
        # [B, Lq, kvh, group, D] -> [B, kvh, Lq * group, D]: row i * group + g is query i, head g,
        # so K/V are never copied per query head (GQA / MQA).
        grid = grid.reshape(batch, max_q, kv_heads, group, dim).permute(0, 2, 1, 3, 4)
        grid = grid.reshape(batch, kv_heads, max_q * group, dim)

        # [B, max_blocks, block_size, kvh, D] -> [B, kvh, keys, D]
        k_all = k_pages.flatten(1, 2).transpose(1, 2).to(q.dtype)
        v_all = v_pages.flatten(1, 2).transpose(1, 2).to(q.dtype)
        if self.softcap is None:
            out = F.scaled_dot_product_attention(grid, k_all, v_all, attn_mask=meta.mask, scale=scale)
        else:
            logits = self.softcap * torch.tanh(grid @ k_all.transpose(-1, -2) * scale / self.softcap)
            weights = logits.masked_fill(~meta.mask, float("-inf")).float().softmax(-1).to(q.dtype)
            out = weights @ v_all
        kv.seal(meta.step)

        out = out.view(batch, kv_heads, max_q, group, dim).permute(0, 2, 1, 3, 4)
        out = out.reshape(batch * max_q, heads, dim)
        return out if meta.query_index is None else out[meta.query_index]
