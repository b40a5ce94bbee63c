"""The CPU backend: a C++ kernel (kvserve/kernels/csrc) that reads pages where they lie.

No dense copy of the context and no padding to the longest sequence: each (sequence, KV head,
query tile) work item walks its own block table, decodes one block at a time into a small
fp32 buffer (dequantizing int8 / fp8 / int4 / KIVI codes there, or reading the block's
full-precision staging slot), and keeps an online softmax. The query heads of a GQA group share every decoded
block. Offloaded host blocks are read in place too.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from kvserve.attention.backend import AttentionBackend, Pool
from kvserve.attention.metadata import StepMetadata
from kvserve.attention.scores import ScorePlan
from kvserve.attention.page_kinds import ABSMAX, DENSE, GROUPED, HEAD_ABSMAX, page_kind, wide_slots
from kvserve.cache.kv_format import KVFormat
from kvserve.cache.kv_pool import KVPool
from kvserve.kernels import cpu_extension


def _encodes(kind: int | None, fmt: KVFormat) -> bool:
    """Whether the kernel's encoder writes `fmt`'s codes: int8 / fp8 per token, int4 with zero-points."""
    return kind == ABSMAX or (kind == GROUPED and fmt.bits == 4 and not fmt.symmetric)


@dataclass(frozen=True)
class CPUMetadata:
    step: StepMetadata
    step_args: tuple  # the kernel's per-step arguments, shared by every layer


class CPUPagedBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, pool: Pool, num_heads: int) -> None:
        super().__init__(pool, num_heads)
        ext = cpu_extension.load()
        assert ext is not None, "CPUPagedBackend needs the compiled kernels (see unsupported())"
        self.ext: ModuleType = ext
        self.dense = isinstance(pool, KVPool)
        e = self._empty = torch.empty(0)
        # The kernel's per-layer arguments never change (the pool's tensors are fixed): built once.
        if self.dense:
            self.layer_args = [(DENSE, kv.k, e, e, e if kv.host_k is None else kv.host_k,
                                DENSE, kv.v, e, e, e if kv.host_v is None else kv.host_v,
                                0, 0, 0, 0, False, False, e, e, e, e, e, e) for kv in pool.kv]
        else:
            # Per layer (a plan may store layers apart), keys and values: their page kinds, and
            # their channel groups (kv_group_size_k / _v may differ).
            self.kinds = [[page_kind(f) for f in kv.formats] for kv in pool.kv]
            self.groups = [[f.group_size if k == GROUPED else 0 for f, k in zip(kv.formats, kinds)]
                           for kv, kinds in zip(pool.kv, self.kinds)]
            # Layers whose codes the kernel also encodes (bit for bit as kv_format does) when no token is staged.
            self.encodes = [all(_encodes(k, f) for k, f in zip(kinds, kv.formats))
                            for kv, kinds in zip(pool.kv, self.kinds)]
            self.layer_args = [self._layer_args(kv, kinds, groups)
                               for kv, kinds, groups in zip(pool.kv, self.kinds, self.groups)]

    @classmethod
    def unsupported(cls, pool: Pool, device: torch.device) -> str | None:
        if device.type != "cpu":
            return "runs on the CPU only"
        if not isinstance(pool, KVPool):
            names = sorted({f.name for f in pool.formats if page_kind(f) is None})
            if names:
                return f"no in-kernel decoder for {', '.join(names)} pages"
        if cpu_extension.load() is None:
            return "the C++ kernels could not be built (see the log)"
        return None

    def prepare(self, step: StepMetadata) -> CPUMetadata:
        plan = step.kv_plan
        stage_of = plan.stage_of if plan is not None and plan.stage_of is not None else self._empty
        return CPUMetadata(step, (step.query_start, step.context_lens, step.block_tables, stage_of))

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
                for x, kind, fields, group in zip((k, v), self.kinds[layer], kv.fields, self.groups[layer]):
                    self.ext.encode_write(x, meta.step.slot_mapping, kind, fields["codes"], fields["scale"],
                                          fields.get("zero", self._empty), group)
            else:
                kv.write(k, v, meta.step)
            new, staging = (self._empty, self._empty, self._empty), kv.staging
        out = self.ext.paged_attention(q, *new, query_start, context_lens, tables, *self.layer_args[layer],
                                       stage_of, *staging, scale, self.pool.block_size, self.pool.num_kv_heads,
                                       score_first, scores)
        kv.seal(meta.step)
        return out

    def _layer_args(self, kv: Any, kinds: list[int | None], groups: list[int]) -> tuple:
        """Keys' and values' sources, then their groups, code widths, symmetric flags, and side
        tables (sink, wide-channel bit plane, channel-to-bit table; empty where unused)."""
        e = self._empty
        sides = []
        for fmt, fields in zip(kv.formats, kv.fields):
            slots = wide_slots(fmt, self.pool.head_dim)
            sides += [fields.get("sink", e), fields.get("wide", e), e if slots is None else slots]
        return (*self._source(kinds[0], kv.formats[0], kv.fields[0]),
                *self._source(kinds[1], kv.formats[1], kv.fields[1]), *groups,
                *(getattr(f, "bits", 0) for f in kv.formats), *(getattr(f, "symmetric", False) for f in kv.formats),
                *sides)

    def _source(self, kind: int | None, fmt: KVFormat, fields: dict[str, torch.Tensor]) -> tuple:
        e = self._empty
        if kind == DENSE:
            return DENSE, fields["data"], e, e, e
        if kind == HEAD_ABSMAX:
            return kind, fields["codes"], fmt.head_scale, e, e
        return kind, fields["codes"], fields["scale"], fields.get("zero", e), e
