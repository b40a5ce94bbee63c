"""The interface between the model and attention kernels.

A backend owns how attention reads the pool's pages for one configuration: it turns the
runner's `StepMetadata` into what its kernel needs (once per step, `prepare`), then for every
layer writes the new K/V into the pages and attends over the block tables (`forward`).

A sliding-window layer (Mistral, Qwen's windowed layers, Gemma 3's local ones) names its window
in the call; the backend's `with_window` turns the step's metadata into that of a layer whose
queries see only the last `window` positions, built once per step, group and window. The
window always masks; with the hybrid KV cache (cache/kv_groups.py) a sliding layer's group also
frees the blocks before it, whose table entries then name the never-written null block.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Generic, TypeVar

import torch

from kvserve.attention.metadata import StepMetadata
from kvserve.attention.rotation import KVRotation, rotate
from kvserve.attention.scores import ScorePlan, slot_scores
from kvserve.cache.kv_pool import KVPool
from kvserve.cache.quantized_pool import QuantizedKVPool
from kvserve.profiling import label

Pool = KVPool | QuantizedKVPool
M = TypeVar("M")  # a backend's per-step metadata, made by its `prepare`


class AttentionBackend(ABC, Generic[M]):
    name: ClassVar[str]
    masks_window: ClassVar[bool] = False  # whether `with_window` is implemented
    caps_logits: ClassVar[bool] = False   # whether `softcap` is implemented

    def __init__(self, pool: Pool, num_heads: int, softcap: float | None = None) -> None:
        """`softcap`: each attention logit (after the scale) becomes softcap * tanh(logit /
        softcap) before the softmax (Gemma 2's `attn_logit_softcapping`); None: uncapped."""
        self.pool = pool
        self.num_heads = num_heads
        self.softcap = softcap

    @classmethod
    @abstractmethod
    def unsupported(cls, pool: Pool, device: torch.device) -> str | None:
        """Why this backend cannot serve `pool` on `device`; None when it can."""

    @abstractmethod
    def prepare(self, step: StepMetadata) -> M:
        """The backend's per-step metadata, built once and shared by every layer."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: M,
                scale: float) -> torch.Tensor:
        """q [T, heads, D], k/v [T, kv_heads, D] of the step's new tokens: stores k/v in layer
        `layer`'s pages, returns attention over each sequence's context [T, heads, D]."""

    def with_window(self, meta: M, window: int) -> M:
        """`meta` (this step's, from `prepare`) for a layer whose query at position p sees the keys
        at p - window + 1 .. p only (transformers' sliding-window mask)."""
        raise ValueError(f"EngineConfig.attention_backend: the {self.name} backend has no sliding-window mask, "
                         f"and this model has layers that attend to the last {window} positions only; use "
                         f"attention_backend='torch' (which 'auto' picks for such a model)")

    def graph_unsupported(self) -> str | None:
        """Why a decode step of this backend cannot be replayed from a CUDA graph; None when it
        can (then `prepare_graph` must be implemented)."""
        return f"the {self.name} backend plans every step on the host"

    def prepare_graph(self, step: StepMetadata, context_lens: torch.Tensor, max_context: int) -> M:
        """`prepare` for a decode step captured in a CUDA graph: the metadata reads `step`'s device
        tensors and `context_lens` ([B] int32, on the device) in place at every replay, and holds
        no choice made from one step's values (contexts up to `max_context`)."""
        raise NotImplementedError(self.graph_unsupported())

    def forward_scored(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: M,
                       scale: float, plan: ScorePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, and the attention `plan`'s sequences give each slot [n, kv_heads, S]
        (see attention/scores.py). Here recomputed in torch from the pages; a kernel that has
        the weights at hand overrides this."""
        out = self.forward(layer, q, k, v, meta, scale)
        return out, slot_scores(self.pool.kv[layer], q, plan, scale, self.softcap)


@dataclass(frozen=True)
class StepAttention(Generic[M]):
    """One step's attention as the model sees it: a backend bound to its prepared metadata, one
    per KV cache group (`metas`; a layer finds its group and pool tensor in `layer_map`, None
    when one group holds layer i in tensor i). With a `scoring` plan, each layer also fills its
    row of `scores` [layers, n, kv_heads, slots], the step's second output beside the logits (see
    attention/scores.py). With a `rotation`, q, k (unless it rotates values only) and v are
    rotated before the backend and the output back after it (attention/rotation.py). `windowed`
    holds a group's metadata per sliding window, made on first use."""
    backend: AttentionBackend[M]
    step: StepMetadata
    metas: tuple[M, ...]
    scoring: ScorePlan | None = None
    scores: torch.Tensor | None = None
    rotation: KVRotation | None = None
    layer_map: tuple[tuple[int, int], ...] | None = None
    windowed: dict[tuple[int, int], M] = field(default_factory=dict)

    @classmethod
    def of(cls, backend: AttentionBackend[M], step: StepMetadata, scoring: ScorePlan | None = None,
           rotation: KVRotation | None = None, other_groups: tuple[StepMetadata, ...] = (),
           layer_map: tuple[tuple[int, int], ...] | None = None) -> "StepAttention[M]":
        """`step`: the first KV cache group's metadata; `other_groups`: the same tokens over the
        other groups' block tables (cache/kv_groups.py)."""
        scores = None
        if scoring is not None:
            pool = backend.pool
            scores = torch.zeros(len(pool.kv), len(scoring.batch_index), pool.num_kv_heads, scoring.max_slots,
                                 device=step.block_tables.device)
        metas = tuple(backend.prepare(s) for s in (step, *other_groups))
        return cls(backend, step, metas, scoring, scores, rotation, layer_map)

    @property
    def positions(self) -> torch.Tensor:
        return self.step.positions

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float, window: int | None = None) -> torch.Tensor:
        """`window`: the layer's sliding window; None for a layer that sees its whole context."""
        with label("kvserve.attention"):  # for the doctor's profile of a step
            group, slot = (0, layer) if self.layer_map is None else self.layer_map[layer]
            meta = self.metas[group] if window is None else self._windowed(group, window)
            r = None if self.rotation is None else self.rotation.matrix
            if r is not None:
                if self.rotation.keys:
                    q, k = rotate(q, r), rotate(k, r)
                v = rotate(v, r)
            if self.scoring is None:
                out = self.backend.forward(slot, q, k, v, meta, scale)
            else:  # rotated queries over rotated keys: the same weights
                out, self.scores[layer] = self.backend.forward_scored(slot, q, k, v, meta, scale, self.scoring)
            return out if r is None else rotate(out, r.T)

    def _windowed(self, group: int, window: int) -> M:
        if (group, window) not in self.windowed:
            if self.scoring is not None:  # slot_scores' causal mask would count the keys the window hides
                raise ValueError(f"kv_eviction: policies that rank tokens by attention are not built for "
                                 f"sliding-window layers (window {window})")
            self.windowed[group, window] = self.backend.with_window(self.metas[group], window)
        return self.windowed[group, window]
