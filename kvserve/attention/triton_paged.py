"""The GPU backend: Triton kernels (kvserve/kernels/triton_attention.py) over pages in place.

New K/V are written by the pool (dense: one scatter per layer; compressed: its encoder), then
one kernel launch per layer attends for every sequence of the step, prefill and decode alike,
decoding int8 / fp8 / int4 / KIVI pages in registers. Offloaded host blocks are not reachable
from a GPU kernel: pools with host blocks use the torch backend. A sliding-window layer's tiles
start at their first query's first key (`with_window`): earlier blocks are never read.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from kvserve.attention.backend import AttentionBackend, Pool
from kvserve.attention.metadata import StepMetadata
from kvserve.attention.page_kinds import fitted_names, kernel_unsupported, wide_slots
from kvserve.cache.formats import PageKind
from kvserve.cache.kv_pool import KVPool


def _kernels() -> ModuleType | None:
    try:
        from kvserve.kernels import triton_attention
    except ImportError:
        return None
    return triton_attention


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class TritonMetadata:
    step: StepMetadata
    tiles: Any  # triton_attention.Tiles
    window: int = 0  # a sliding layer's window (`with_window`); 0: none


class TritonPagedBackend(AttentionBackend[TritonMetadata]):
    name = "triton"
    masks_window = True

    def __init__(self, pool: Pool, num_heads: int, softcap: float | None = None) -> None:
        super().__init__(pool, num_heads, softcap)
        kernels = _kernels()
        assert kernels is not None, "TritonPagedBackend needs triton (see unsupported())"
        self.kernels = kernels
        self.dense = isinstance(pool, KVPool)
        self.sources = [self._sources(kv) for kv in pool.kv]

    @classmethod
    def unsupported(cls, pool: Pool, device: torch.device) -> str | None:
        if device.type != "cuda" and not (device.type == "cpu" and _interpreted()):
            return "runs on CUDA (on the CPU only under TRITON_INTERPRET=1, for tests)"
        if _kernels() is None:
            return "triton is not installed"
        dim = pool.head_dim
        if dim < 16 or dim & (dim - 1):
            return f"head_dim {dim} is not a power of two >= 16"
        if isinstance(pool, KVPool):
            if pool.host_layers:
                return "offloaded host blocks are not reachable from a GPU kernel"
            return None
        names = kernel_unsupported(pool.formats) or fitted_names(pool.formats)
        return f"no in-register decoder for {', '.join(names)} pages" if names else None

    def prepare(self, step: StepMetadata) -> TritonMetadata:
        group = self.num_heads // self.pool.num_kv_heads
        tiles = self.kernels.plan_tiles(step.query_start, step.context_lens, step.block_tables,
                                        step.max_query_len, group, self.pool.num_kv_heads)
        return TritonMetadata(step, tiles)

    def with_window(self, meta: TritonMetadata, window: int) -> TritonMetadata:
        """The kernel masks keys before slot q - window + 1 and skips the blocks before the window;
        fewer context splits may do. Reads no step's values: graph-captured metadata takes it too."""
        if meta.step.evicts:  # as the torch backend: the window is a span of positions, masked in slots
            raise ValueError(f"kv_eviction: a sliding window (of {window} positions) cannot mask a sequence that "
                             f"has evicted tokens: its slots no longer sit at their positions")
        return dataclasses.replace(meta, tiles=self.kernels.window_tiles(meta.tiles, window, self.pool.num_kv_heads),
                                   window=window)

    def graph_unsupported(self) -> str | None:
        return None if self.dense else "compressed pages plan each step's writes on the host"

    def prepare_graph(self, step: StepMetadata, context_lens: torch.Tensor, max_context: int) -> TritonMetadata:
        tiles = self.kernels.decode_tiles(context_lens, step.block_tables, max_context,
                                          self.num_heads // self.pool.num_kv_heads, self.pool.num_kv_heads)
        return TritonMetadata(step, tiles)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: TritonMetadata,
                scale: float) -> torch.Tensor:
        kv = self.pool.kv[layer]
        kv.write(k, v, meta.step)
        k_src, v_src = self.sources[layer]
        plan = meta.step.kv_plan
        stage_of = None if self.dense or plan.stage_of is None else plan.stage_of
        k_stage, v_stage = (None, None) if stage_of is None else kv.staging
        out = self.kernels.paged_attention(q.contiguous(), meta.tiles, k_src, v_src, stage_of, k_stage, v_stage,
                                           scale, self.pool.block_size, self.pool.num_kv_heads, meta.window)
        kv.seal(meta.step)
        return out

    def _sources(self, kv: Any) -> tuple:
        source = self.kernels.PageSource
        dense = int(PageKind.DENSE)
        if self.dense:
            return source(dense, kv.k, kv.k, kv.k), source(dense, kv.v, kv.v, kv.v)
        out = []
        for layout, fields in zip((f.layout for f in kv.formats), kv.fields):
            kind = int(layout.kind)
            if layout.kind == PageKind.DENSE:
                out.append(source(kind, fields["data"], fields["data"], fields["data"]))
            elif layout.kind == PageKind.ABSMAX:
                out.append(source(kind, fields["codes"], fields["scale"], fields["codes"]))
            elif layout.kind == PageKind.HEAD_ABSMAX:
                out.append(source(kind, fields["codes"], layout.head_scale, fields["codes"]))
            else:
                zero = fields["codes"] if layout.symmetric else fields["zero"]  # never read when symmetric
                out.append(source(kind, fields["codes"], fields["scale"], zero, bits=layout.bits,
                                  group=layout.group_size if layout.kind == PageKind.GROUPED else 1,
                                  sink=fields.get("sink"), symmetric=layout.symmetric, wide=fields.get("wide"),
                                  wide_slot=_device(wide_slots(layout, self.pool.head_dim), fields["codes"].device)))
        return tuple(out)


def _device(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)
