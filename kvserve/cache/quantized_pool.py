"""A KV pool that stores pages compressed (`kvserve.cache.formats`), codes and scales inside each block.

Writes encode the step's new tokens; reads decode only the blocks in the step's block tables,
one layer at a time, so the whole cache is never expanded.

A residual of the most recent tokens stays in full precision, in a small staging area: a block gets
a staging slot while any of its tokens is within `residual` tokens of its sequence's end (or while
it is not full, for formats that encode a whole block at once, such as KIVI keys). Once out of the
window it is sealed: encoded from the staging slot into its own pages, and the slot is freed.
Sealing happens after the step's attention (`seal`), so a step reads the tokens it brings in full
precision, as HF's QuantizedCache and vLLM do: a prompt attends to itself exactly and only later
steps read its codes. A block whose tokens all arrive in one step already out of the window (most
of a long prompt) takes a staging slot for that step only. Which block holds which slot is the block
manager's (cache/staging_slots.py); its plan for a step becomes index tensors once
(`write_plan`) and is applied by every layer. Each layer has its own (keys, values) formats (one pair
for all, or a per-layer plan, `cache/kv_plan.py`); a block holds every layer's fields, so its bytes
are their sum.

A block shared by several sequences (prefix cache, forks) is sealed when the first of them
moves past it, so another sharer may read it encoded before its own window would: with
compressed pages, a request's output can depend slightly on what else ran. Likewise, with a
residual window or a block-encoded format, where steps end (a prompt cut into chunks, a
recompute after preemption that runs prompt and outputs in one step, a prefix hit reading
sealed codes) changes which tokens later steps read as codes; formats coded token by token
without a residual replay exactly.

The KV budget pays for the staging slots first (`staging_slots`, sized for the worst case);
blocks take the rest. Staging is planned on tensor-parallel rank 0 alone: every rank applies the
plan it is sent, copy-on-write copies included (`WritePlan.stage_copies`).
"""
from __future__ import annotations


import torch

from kvserve.cache.compaction import Compaction, move_slots
from kvserve.cache.formats import Fields, KVFormat
from kvserve.cache.page_step import PageStep, WritePlan
from kvserve.cache.staging_slots import StagingPlan
from kvserve.huge_pages import huge_page_zeros


def encode_blocks(fmt: KVFormat, x: torch.Tensor) -> Fields:
    """x [n, block_size, H, D] -> fields [n, *shape] for any format."""
    if not fmt.per_token:
        return fmt.encode(x)
    return {name: t.unflatten(0, x.shape[:2]) for name, t in fmt.encode(x.flatten(0, 1)).items()}


LayerFormats = tuple[KVFormat, KVFormat]  # (keys, values)


def _plan_of(step: PageStep) -> WritePlan:
    assert step.kv_plan is not None, "QuantizedKVPool.write_plan makes one for every step"
    return step.kv_plan


class QuantizedLayerKV:
    def __init__(self, pool: "QuantizedKVPool", formats: LayerFormats, fields: list[Fields]) -> None:
        """`fields`: each format's zeroed tensors, [num_blocks, *shape] (QuantizedKVPool makes
        every layer's in one region)."""
        self.pool = pool
        self.formats = formats
        p = pool
        self.fields = fields
        staging = (p.num_staging, p.block_size, p.num_kv_heads, p.head_dim)
        self.staging = [torch.zeros(staging, dtype=p.dtype, device=p.device) for _ in range(2)]

    def write(self, k: torch.Tensor, v: torch.Tensor, meta: PageStep) -> None:
        """The step's new K/V, before its attention: encoded into their slots, or staged."""
        plan = _plan_of(meta)
        for x, fmt, fields, staging in zip((k, v), self.formats, self.fields, self.staging):
            if plan.per_token:
                for name, t in fmt.encode(x).items():
                    fields[name].view(-1, *t.shape[1:])[meta.slot_mapping] = t
            if len(plan.staged_tokens):
                staging.view(-1, *x.shape[1:])[plan.staged_slots] = x[plan.staged_tokens].to(staging.dtype)

    def seal(self, meta: PageStep) -> None:
        """After the step's attention: the blocks that left the window, encoded from staging."""
        plan = _plan_of(meta)
        if len(plan.seal_blocks):
            self.seal_blocks(plan.seal_blocks, plan.seal_stages)

    def seal_blocks(self, blocks: torch.Tensor, stages: torch.Tensor) -> None:
        """Each block's pages encoded from its full-precision copy in staging slot `stages[i]`."""
        for fmt, fields, staging in zip(self.formats, self.fields, self.staging):
            for name, t in encode_blocks(fmt, staging[stages]).items():
                fields[name][blocks] = t

    def gather(self, meta: PageStep) -> tuple[torch.Tensor, torch.Tensor]:
        tables = meta.block_tables
        plan = _plan_of(meta)
        out = []
        for fmt, fields, staging in zip(self.formats, self.fields, self.staging):
            pages = fmt.decode({name: f[tables] for name, f in fields.items()}, self.pool.dtype)
            if plan.stage_of is not None:
                stage = plan.stage_of[tables]
                pages = torch.where((stage >= 0)[..., None, None, None], staging[stage.clamp(min=0)], pages)
            out.append(pages)
        return out[0], out[1]


class QuantizedKVPool:
    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, layer_formats: list[LayerFormats], residual: int, num_staging: int) -> None:
        if num_blocks < 1:
            raise ValueError("KVPool.num_blocks must be at least 1")
        self.num_blocks, self.block_size, self.dtype, self.device = num_blocks, block_size, dtype, device
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.residual = residual
        self.staged = num_staging > 0
        self.num_staging = num_staging
        # Every layer's fields in one region (huge_pages.py), in layer, format, field order.
        specs = [fmt.fields(num_kv_heads, head_dim, block_size) for formats in layer_formats for fmt in formats]
        tensors = iter(huge_page_zeros([((num_blocks, *shape), dtype) for fields in specs
                                        for shape, dtype in fields.values()], device))
        made = iter([{name: next(tensors) for name in fields} for fields in specs])
        self.kv = [QuantizedLayerKV(self, formats, [next(made) for _ in formats]) for formats in layer_formats]
        # Without staging every step's plan is the same: encode each token into its slot.
        none = torch.zeros(0, dtype=torch.long, device=device)
        self._per_token_plan = WritePlan(True, none, none, none, none, None)

    @property
    def formats(self) -> list[KVFormat]:
        """Every layer's formats, keys and values (as a backend asks: can I read all of them?)."""
        return [f for layer in self.kv for f in layer.formats]

    @property
    def block_tensors(self) -> list[torch.Tensor]:
        """Every field indexed by block, in a fixed order (cache/block_bytes.py); a staged block's
        full-precision copy is not among them (EngineConfig keeps kv_remote off staged pools)."""
        return [t for layer in self.kv for fields in layer.fields for t in fields.values()]

    @staticmethod
    def bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int, layer_formats: list[LayerFormats]) -> int:
        per_token = sum(f.bytes_per_token(num_kv_heads, head_dim, block_size) for pair in layer_formats for f in pair)
        return round(block_size * per_token)

    @staticmethod
    def staging_slots(max_num_seqs: int, block_size: int, residual: int, layer_formats: list[LayerFormats],
                      tokens_per_step: int) -> int:
        """0 without a residual window or a block-wise format in any layer; else each running
        sequence stages its window, its partial block, and one copy-on-write copy, and the
        blocks a step fills whole wait in staging until its attention is done."""
        if residual == 0 and all(f.per_token for pair in layer_formats for f in pair):
            return 0
        return max_num_seqs * (-(-residual // block_size) + 2) + tokens_per_step // block_size

    def seal(self, seals: tuple[tuple[int, int], ...]) -> None:
        """A BlockOps' seals, (staging slot, block): outside a step, on every rank."""
        stages = self._dev(torch.tensor([s for s, _ in seals], dtype=torch.long))
        blocks = self._dev(torch.tensor([b for _, b in seals], dtype=torch.long))
        for layer in self.kv:
            layer.seal_blocks(blocks, stages)

    def write_plan(self, staging: StagingPlan | None) -> WritePlan:
        """Where the step's tokens go, as index tensors: `staging` (the block manager's plan,
        cache/staging_slots.py), or each token into its slot when the pool stages nothing."""
        if staging is None:
            return self._per_token_plan
        tokens = [torch.arange(t, t + n) for t, _, n in staging.staged]
        slots = [torch.arange(p, p + n) for _, p, n in staging.staged]
        stage_of = torch.full((self.num_blocks,), -1, dtype=torch.long)
        if staging.reads:
            stage_of[[b for b, _ in staging.reads]] = torch.tensor([s for _, s in staging.reads])

        def cat(parts: list[torch.Tensor]) -> torch.Tensor:
            return self._dev(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long))

        return WritePlan(False, cat(tokens), cat(slots),
                        self._dev(torch.tensor([s for _, s in staging.seals], dtype=torch.long)),
                        self._dev(torch.tensor([b for b, _ in staging.seals], dtype=torch.long)),
                        self._dev(stage_of), staging.copies)

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def copy_blocks(self, pairs: list[tuple[int, int]], plan: WritePlan | None = None) -> None:
        """Copy-on-write: codes, scales and (if staged) the full-precision staging copy, between
        the slots the step's `plan` paired (the plan, not this pool's own bookkeeping: tensor-
        parallel ranks other than 0 never plan)."""
        if not pairs:
            return
        src = self._dev(torch.tensor([s for s, _ in pairs]))
        dst = self._dev(torch.tensor([d for _, d in pairs]))
        staged = list(plan.stage_copies) if plan is not None else []
        for layer in self.kv:
            for fields, staging in zip(layer.fields, layer.staging):
                for f in fields.values():
                    f[dst] = f[src]
                for s, d in staged:
                    staging[d] = staging[s]

    def compact(self, compactions: tuple[Compaction, ...]) -> None:
        """Token eviction's moves in every field of per-token formats (codes and scales move
        with their token); one sequence after another, as KVPool.compact."""
        assert not self.staged and all(f.per_token for f in self.formats), "EngineConfig checks"
        for c in compactions:
            self.copy_blocks(list(c.copies))
            move_slots([[t for fields in layer.fields for t in fields.values()] for layer in self.kv], c)

    def kept_fraction(self) -> dict[str, float]:
        """For sparse formats: the fraction of K / V entries stored, over every token-head written
        so far (one with any entry kept; the largest always passes the threshold)."""
        out = {}
        for i, kind in enumerate("kv"):
            layers = [layer for layer in self.kv if hasattr(layer.formats[i], "kept_fraction")]
            if layers:
                written = torch.cat([f["val"][(f["val"] != 0).any(-1)] for f in (layer.fields[i] for layer in layers)])
                out[kind] = layers[0].formats[i].kept_fraction({"val": written}) if len(written) else 0.0
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.kv for fields in layer.fields for t in fields.values()) + \
            sum(s.nbytes for layer in self.kv for s in layer.staging)
