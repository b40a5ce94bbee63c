"""The CPU backend: a C++ kernel (kvserve/kernels/csrc) that reads pages where they lie.

No dense copy of the context and no padding to the longest sequence: each (sequence, KV head,
query tile) work item walks its own block table, decodes one block at a time into a small
fp32 buffer (dequantizing int8 / fp8 / int4 / KIVI codes there, or reading the block's
full-precision staging slot), and keeps an online softmax. The query heads of a GQA group share every decoded
block. Dense bf16 pages are attended a span of 4 blocks at a time (one softmax update per span),
spans fixed in the block table so that a decode and a prompt's rows get the same bits. Offloaded host blocks are read in place too. A sliding-window layer's items start at the
block holding their first query's first key (`with_window`): earlier blocks are never read.
Fitted int8 / fp8 codes (cache/formats/fitted.py) are read as absmax ones: their keys' offset is
left out (softmax cancels it), their spread folded into the query, and `encode_fitted_write`
writes them; beside full-precision staging they are refused (the staged keys keep the offset).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from kvserve.attention.backend import AttentionBackend, Pool
from kvserve.attention.metadata import StepMetadata
from kvserve.attention.scores import ScorePlan
from kvserve.attention.page_kinds import fitted_names, kernel_unsupported, wide_slots
from kvserve.cache.formats import PageKind, PageLayout
from kvserve.cache.kv_pool import KVPool
from kvserve.kernels import cpu_extension


def _encodes(layout: PageLayout) -> bool:
    """Whether the kernel's encoder writes these codes: int8 / fp8 per token with absmax scales,
    4-bit groups with zero-points."""
    return (layout.kind == PageKind.ABSMAX and not layout.fitted) or (
        layout.kind == PageKind.GROUPED and layout.bits == 4 and not layout.symmetric)


def _query_scale(layout: PageLayout, num_heads: int) -> torch.Tensor | None:
    """[num_heads, D] fp32: fitted keys' channel spread (`FitTables.spread`) for each query head (a
    GQA group's heads share their KV head's); None where the keys have none."""
    scale = None if layout.fit is None else layout.fit.spread
    return None if scale is None else scale.float().repeat_interleave(num_heads // scale.shape[0], dim=0)


@dataclass(frozen=True)
class CPUMetadata:
    step: StepMetadata
    step_args: tuple  # the kernel's per-step arguments, shared by every layer
    window: int = 0   # a sliding layer's window (`with_window`); 0: none


class CPUPagedBackend(AttentionBackend[CPUMetadata]):
    name = "cpu"
    masks_window = True

    def __init__(self, pool: Pool, num_heads: int, softcap: float | None = None) -> None:
        super().__init__(pool, num_heads, softcap)
        ext = cpu_extension.load()
        assert ext is not None, "CPUPagedBackend needs the compiled kernels (see unsupported())"
        self.ext: ModuleType = ext
        self.dense = isinstance(pool, KVPool)
        e = self._empty = torch.empty(0)
        # The kernel's per-layer arguments never change (the pool's tensors are fixed): built once.
        if self.dense:
            dense = int(PageKind.DENSE)
            self.layer_args = [(dense, kv.k, e, e, e if kv.host_k is None else kv.host_k,
                                dense, kv.v, e, e, e if kv.host_v is None else kv.host_v,
                                0, 0, 0, 0, False, False, e, e, e, e, e, e) for kv in pool.kv]
        else:
            # Per layer (a plan may store layers apart), keys' and values' page layouts (their
            # kinds and channel groups: kv_group_size_k / _v may differ).
            self.layouts = [[f.layout for f in kv.formats] for kv in pool.kv]
            # Layers whose codes the kernel also encodes (bit for bit as the format does) when no token is staged.
            self.encodes = [all(_encodes(layout) for layout in layouts) for layouts in self.layouts]
            self.layer_args = [self._layer_args(kv, layouts) for kv, layouts in zip(pool.kv, self.layouts)]
            self.query_scales = [_query_scale(layouts[0], num_heads) for layouts in self.layouts]
            # Layers whose keys and values are both fitted codes, which `encode_fitted_write` writes.
            self.fits = [all(layout.fitted for layout in layouts) for layouts in self.layouts]

    @classmethod
    def unsupported(cls, pool: Pool, device: torch.device) -> str | None:
        if device.type != "cpu":
            return "runs on the CPU only"
        if not isinstance(pool, KVPool):
            names = kernel_unsupported(pool.formats)
            if names:
                return f"no in-kernel decoder for {', '.join(names)} pages"
            fitted = fitted_names(pool.formats)
            if fitted and pool.staged:
                # The kernel reads staged keys as they are, with the offset it leaves out of the
                # fitted ones and undivided by the spread it folds into the query.
                return (f"{', '.join(fitted)} pages with full-precision staging (kv_residual, or a KIVI layer "
                        f"beside them): the staged keys would be read without the fitted keys' offset")
        if cpu_extension.load() is None:
            return "the C++ kernels could not be built (see the log)"
        return None

    def prepare(self, step: StepMetadata) -> CPUMetadata:
        plan = step.kv_plan
        stage_of = plan.stage_of if plan is not None and plan.stage_of is not None else self._empty
        return CPUMetadata(step, (step.query_start, step.context_lens, step.block_tables, stage_of))

    def with_window(self, meta: CPUMetadata, window: int) -> CPUMetadata:
        """The kernel masks keys before slot q - window + 1 and skips the blocks before the window."""
        if meta.step.evicts:  # as the torch backend: the window is a span of positions, masked in slots
            raise ValueError(f"kv_eviction: a sliding window (of {window} positions) cannot mask a sequence that "
                             f"has evicted tokens: its slots no longer sit at their positions")
        return dataclasses.replace(meta, window=window)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: CPUMetadata,
                scale: float) -> torch.Tensor:
        return self._run(layer, q, k, v, meta, scale, self._empty, self._empty)

    def forward_scored(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: CPUMetadata,
                       scale: float, plan: ScorePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel adds the weights in a second pass over each scored sequence's keys, once its
        softmax is final: no gather, no padded copy."""
        scores = torch.zeros(len(plan.first_row), self.pool.num_kv_heads, plan.max_slots)
        out = self._run(layer, q, k, v, meta, scale, plan.first_row, scores)
        return out, scores[plan.batch_index]

    def _run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: CPUMetadata,
             scale: float, score_first: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        kv = self.pool.kv[layer]
        query_start, context_lens, tables, stage_of = meta.step_args
        if self.dense:  # the kernel writes dense pages itself
            new, staging = (k, v, meta.step.slot_mapping), (self._empty, self._empty)
        else:
            plan = meta.step.kv_plan
            if self.encodes[layer] and plan.per_token:
                for x, layout, fields in zip((k, v), self.layouts[layer], kv.fields):
                    self.ext.encode_write(x, meta.step.slot_mapping, int(layout.kind), fields["codes"],
                                          fields["scale"], fields.get("zero", self._empty), layout.group_size)
            elif self.fits[layer] and plan.per_token:
                for x, layout, fields in zip((k, v), self.layouts[layer], kv.fields):
                    self.ext.encode_fitted_write(x, meta.step.slot_mapping, fields["codes"], fields["scale"],
                                                 *layout.fit.kernel_args(self._empty))
            else:
                kv.write(k, v, meta.step)
            new, staging = (self._empty, self._empty, self._empty), kv.staging
            if self.query_scales[layer] is not None:  # keys' channel scale, folded into the query
                q = (q.float() * self.query_scales[layer]).to(q.dtype)
        out = self.ext.paged_attention(q, *new, query_start, context_lens, tables, *self.layer_args[layer],
                                       stage_of, *staging, scale, self.pool.block_size, self.pool.num_kv_heads,
                                       meta.window, score_first, scores)
        kv.seal(meta.step)
        return out

    def _layer_args(self, kv: Any, layouts: list[PageLayout]) -> tuple:
        """Keys' and values' sources, then their groups (GROUPED only), code widths, symmetric
        flags, and side tables (sink, wide-channel bit plane, channel-to-bit table; empty where unused)."""
        e = self._empty
        sides = []
        for layout, fields in zip(layouts, kv.fields):
            slots = wide_slots(layout, self.pool.head_dim)
            sides += [fields.get("sink", e), fields.get("wide", e), e if slots is None else slots]
        return (*self._source(layouts[0], kv.fields[0]), *self._source(layouts[1], kv.fields[1]),
                *(layout.group_size if layout.kind == PageKind.GROUPED else 0 for layout in layouts),
                *(layout.bits for layout in layouts), *(layout.symmetric for layout in layouts), *sides)

    def _source(self, layout: PageLayout, fields: dict[str, torch.Tensor]) -> tuple:
        e, kind = self._empty, int(layout.kind)
        if layout.kind == PageKind.DENSE:
            return kind, fields["data"], e, e, e
        if layout.kind == PageKind.HEAD_ABSMAX:
            return kind, fields["codes"], layout.head_scale, e, e
        return kind, fields["codes"], fields["scale"], fields.get("zero", e), e
