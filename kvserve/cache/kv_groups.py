"""KV cache groups: which layers share block tables, and where their pages lie in the pool.

A layer's `KVSpec` says what its attention reads: every position (full attention) or the last
`window` positions (a sliding window). Layers of one spec are cut into groups of equal size,
`layers_per_block` each; every group has its own block table per sequence, all drawn from one
pool of blocks, and a block holds `layers_per_block` layers' pages (vLLM v1's hybrid allocator).
Layer l lives in tensor `slot(l)` of whichever block its group's table names, so a block id means
the same bytes whichever group owns it: copy-on-write, swaps and loads copy whole blocks.

A sliding group's table keeps real blocks only for the positions its window can still see;
entries before are `NULL_BLOCK`, a reserved all-zero block never written nor read (the window
masks it). A sequence of n tokens thus costs full groups ceil(n / block_size) blocks each and a
sliding group at most ceil(window / block_size) + 1.

With one spec, or with the hybrid path switched off, every layer is one full group and nothing
differs from a plain paged cache: the layers' windows then mask, and free nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

NULL_BLOCK = 0  # a sliding group's table entry for a block its window no longer sees


@dataclass(frozen=True)
class KVSpec:
    """What one layer's attention reads: its whole context (`window` None) or its last `window` positions."""
    window: int | None = None

    def first_needed(self, position: int) -> int:
        """The first position a query at `position` or later still reads."""
        return 0 if self.window is None else max(0, position - self.window + 1)


@dataclass(frozen=True)
class KVCacheGroup:
    spec: KVSpec
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVGroups:
    groups: tuple[KVCacheGroup, ...]
    layers_per_block: int  # the pool's tensors per block: the most layers of any group

    @staticmethod
    def of(layer_windows: tuple[int | None, ...], hybrid: bool = True) -> "KVGroups":
        """The groups of a model whose layer i sees the last `layer_windows[i]` positions (None:
        all). Not `hybrid`, or one kind of layer only: one group of every layer, of the kind
        they share (a sliding-window-only model frees blocks as well)."""
        kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
        if not hybrid:
            kinds = [None]
        if len(kinds) == 1:
            return KVGroups((KVCacheGroup(KVSpec(kinds[0]), tuple(range(len(layer_windows)))),),
                            len(layer_windows))
        by_kind = {w: tuple(i for i, lw in enumerate(layer_windows) if lw == w) for w in kinds}
        # A block holds `size` layers; a kind's last group may hold fewer, and its block's spare
        # tensors are paid for unused. The largest size (fewest groups: a table and a metadata
        # build each per step) that leaves at most 5% of the tensors spare: Gemma 3 270M's 3 full
        # and 15 sliding layers in 6 groups of 3, 1B's 4 and 22 in 13 of 2 (4 would leave 2 of 28).
        counts = [len(layers) for layers in by_kind.values()]
        size = max(s for s in range(1, min(counts) + 1)
                   if s * sum(-(-c // s) for c in counts) - len(layer_windows) <= 0.05 * len(layer_windows))
        groups = tuple(KVCacheGroup(KVSpec(w), layers[i:i + size])
                       for w, layers in by_kind.items() for i in range(0, len(layers), size))
        return KVGroups(groups, size)

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def windowed(self) -> bool:
        """Some group frees blocks out of its window (and block 0 is reserved as `NULL_BLOCK`)."""
        return any(g.spec.window is not None for g in self.groups)

    def group_of(self, layer: int) -> int:
        return next(i for i, g in enumerate(self.groups) if layer in g.layers)

    def slot(self, layer: int) -> int:
        """The pool tensor holding `layer`'s pages: its place within its group."""
        return self.groups[self.group_of(layer)].layers.index(layer)

    def layer_map(self, num_layers: int) -> tuple[tuple[int, int], ...]:
        """(group, slot) of each layer, for the attention's per-layer lookup."""
        return tuple((self.group_of(layer), self.slot(layer)) for layer in range(num_layers))

    def kinds(self) -> list[str]:
        """Each group's kind, as metrics label it: "full" or "window N"."""
        return ["full" if g.spec.window is None else f"window {g.spec.window}" for g in self.groups]

    def describe(self) -> str:
        """One line for logs and the doctor: each group's kind and layers."""
        return "; ".join(f"{kind}: layers {','.join(map(str, g.layers))}" for kind, g in zip(self.kinds(), self.groups))
