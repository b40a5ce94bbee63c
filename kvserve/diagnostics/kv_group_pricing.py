"""What one layer's KV pages cost in a format, and what each group of layers holds for a sequence.

A full-attention layer keeps every position: a sequence of n tokens holds ceil(n / block_size) of
its blocks. A sliding layer of window w reads only positions max(0, n - w) .. n - 1, so the engine's
hybrid KV cache keeps just the blocks covering those (at most ceil(w / block_size) + 1, however long
the sequence grows) and frees the rest between steps. During a prompt's prefill step every prompt
block is still held in every layer (the window's blocks are released from the next step on), so a
sequence's peak is its every-layer-full price. With the hybrid cache off (the engine's
`disable_hybrid_kv_cache`, `kvserve memory --no-hybrid`) every layer holds every block and its
window only masks.

Prices are per layer, in each layer's own format, so a per-layer plan that stores sliding and full
layers differently is priced as the pages it would fill.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from kvserve.cache.formats import FORMAT_CHOICES, make_format
from kvserve.cache.kv_plan import KVPlan, plan_path
from kvserve.model.config import ModelConfig

FP8_ALIAS = "fp8"  # --dtype fp8 means fp8_e4m3
# kivi keys keep one scale and zero-point per channel per block: their cost per token depends on
# the block size (the engine's default unless one is given).
DEFAULT_BLOCK_SIZE = 16


def kv_dtypes() -> tuple[str, ...]:
    """The --dtype names: fp8 and every registered format, as the registry holds them now."""
    return (FP8_ALIAS, *FORMAT_CHOICES)


@dataclass(frozen=True)
class KVLayout:
    """How pages store K/V, in the engine's terms: `dtype` (a `kv_cache_dtype` name, fp8, or
    plan:PATH), `group_size` (`kv_group_size`; None: the engine's 32), `block_size` (KIVI keys keep
    their ranges per block), `exact_sink` (`kv_exact_sink`), `key_wide_channels`
    (`kv_key_wide_channels`) and `symmetric_values` (`kv_symmetric_values`). Every function below
    takes it whole, so a new format option is one new field here."""
    dtype: str = "fp16"
    group_size: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    exact_sink: bool = False
    key_wide_channels: int = 0
    symmetric_values: bool = False

    def describe(self) -> str:
        return (self.dtype + (f" in groups of {self.group_size}" if self.group_size else "")
                + (", exact sinks" if self.exact_sink else "")
                + (f", {self.key_wide_channels} wide key channels" if self.key_wide_channels else "")
                + (", symmetric values" if self.symmetric_values else ""))


def layer_token_bytes(cfg: ModelConfig, layout: KVLayout) -> tuple[Fraction, ...]:
    """Each layer's bytes for one token's K and V, with whatever scales, zero-points and side tables
    its format stores: each registered format's own fields (kvserve.cache.formats), the pages the
    engine would allocate. A per-layer plan prices each layer in its own pair ("auto" as bf16)."""
    path = plan_path(layout.dtype)
    if path is not None:
        plan = KVPlan.load(path)
        if len(plan.layers) != cfg.num_layers:
            raise ValueError(f"kv plan {path}: names {len(plan.layers)} layers, the model has {cfg.num_layers}")
        pairs = [tuple("bf16" if n == "auto" else n for n in pair) for pair in plan.layers]
    else:
        name = "fp8_e4m3" if layout.dtype == FP8_ALIAS else layout.dtype
        if name not in FORMAT_CHOICES:
            raise ValueError(f"unknown KV dtype {layout.dtype!r}; known: {', '.join(kv_dtypes())} or plan:PATH")
        pairs = [(name, name)] * cfg.num_layers
    # One format build per distinct pair: a plain dtype prices every layer alike.
    prices = {pair: sum((Fraction(make_format(n, role, group_size=layout.group_size or 32,
                                              exact_sink=layout.exact_sink,
                                              key_wide_channels=layout.key_wide_channels,
                                              symmetric_values=layout.symmetric_values)
                                  .bytes_per_token(cfg.num_kv_heads, cfg.head_dim, layout.block_size))
                         for n, role in zip(pair, "kv")), Fraction(0))
              for pair in set(pairs)}
    return tuple(prices[pair] for pair in pairs)


def bytes_per_element(cfg: ModelConfig, layout: KVLayout) -> Fraction:
    """Bytes per K or V element, averaged over the layers and over the codes and whatever scales,
    zero-points and side tables the format stores."""
    return sum(layer_token_bytes(cfg, layout), Fraction(0)) / (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim)


# ---- layer groups ----------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerGroup:
    """Layers that keep the same positions: all of them (`window` None) or the last `window`."""
    window: int | None
    layers: tuple[int, ...]

    @property
    def name(self) -> str:
        return "full attention" if self.window is None else f"sliding window {self.window:,}"

    def blocks(self, tokens: int, block_size: int) -> int:
        """Blocks each of these layers holds for a `tokens`-token sequence between steps."""
        last = (tokens - 1) // block_size
        if self.window is None:
            return last + 1
        # From the block of the window's first position; never more than every block, since that
        # first position is never below 0.
        return last - max(0, tokens - self.window) // block_size + 1

    def most_blocks(self, block_size: int) -> int | None:
        """The most blocks a layer of this group ever holds; None: no bound (full attention)."""
        return None if self.window is None else -(-self.window // block_size) + 1


def layer_groups(cfg: ModelConfig, hybrid: bool = True) -> tuple[LayerGroup, ...]:
    """The model's layers by the positions they keep, full-attention layers first, then each
    window (Gemma 3: every sixth layer full, the rest one window; Mistral v0.1: every layer one
    window). Not `hybrid`: one full group, every layer holding every block."""
    windows = cfg.layer_windows if hybrid else (None,) * cfg.num_layers
    kinds = sorted(set(windows), key=lambda w: -1 if w is None else w)
    return tuple(LayerGroup(w, tuple(i for i, lw in enumerate(windows) if lw == w)) for w in kinds)


def windowed(cfg: ModelConfig, hybrid: bool = True) -> bool:
    """Whether some layer frees blocks its window no longer sees."""
    return hybrid and bool(cfg.sliding_layers)


# ---- a sequence's price ----------------------------------------------------------------------

@dataclass(frozen=True)
class GroupPrice:
    group: LayerGroup
    blocks: int  # held by each of its layers between steps
    bytes: int   # all its layers' blocks


@dataclass(frozen=True)
class SequencePrice:
    """One sequence's KV cache at `tokens` tokens, in whole blocks."""
    tokens: int
    groups: tuple[GroupPrice, ...]
    held: int  # bytes held between steps, each group's blocks
    full: int  # bytes with every layer holding every block: --no-hybrid, and any prompt's prefill step

    @property
    def saving(self) -> float:
        """The share of the every-layer-full bytes the windows free."""
        return 1 - self.held / self.full


def sequence_price(cfg: ModelConfig, layout: KVLayout, tokens: int, hybrid: bool = True) -> SequencePrice:
    """What a sequence of `tokens` tokens holds, group by group, against every layer full.

    Block-granular (a sequence holds whole blocks); a fractional total (int4 groups that split
    unevenly) is rounded up, since memory comes in whole bytes.
    """
    block_size = layout.block_size
    if tokens < 1 or block_size < 1:
        raise ValueError(f"tokens ({tokens}) and block_size ({block_size}) must be positive")
    per_token = layer_token_bytes(cfg, layout)

    def exact(layers: tuple[int, ...], blocks: int) -> Fraction:
        return sum((per_token[i] for i in layers), Fraction(0)) * blocks * block_size

    blocks = [(g, g.blocks(tokens, block_size)) for g in layer_groups(cfg, hybrid)]
    return SequencePrice(
        tokens=tokens,
        groups=tuple(GroupPrice(g, n, math.ceil(exact(g.layers, n))) for g, n in blocks),
        held=math.ceil(sum((exact(g.layers, n) for g, n in blocks), Fraction(0))),
        full=math.ceil(exact(tuple(range(cfg.num_layers)), -(-tokens // block_size))))


def contiguous_bytes(cfg: ModelConfig, layout: KVLayout, max_len: int) -> int:
    """Bytes a sequence reserves up front when its cache cannot grow: `max_len` tokens in a full
    layer, its window (a ring buffer) in a sliding one."""
    return math.ceil(sum((b * min(w or max_len, max_len) for b, w in zip(layer_token_bytes(cfg, layout),
                                                                         cfg.layer_windows)), Fraction(0)))


@dataclass(frozen=True)
class WindowedFit:
    paged: int          # sequences held between steps, each its groups' blocks
    whole_prompts: int  # sequences that each arrive as one seq_len-token prompt, prefilled one at a time
    contiguous: int     # sequences when each reserves max_len tokens in full layers and its window in sliding ones
    price: SequencePrice


def windowed_fit(cfg: ModelConfig, layout: KVLayout, budget_bytes: int, seq_len: int, max_len: int) -> WindowedFit:
    """How many `seq_len`-token sequences of a windowed model a budget holds with the hybrid cache.

    Paged, a sequence holds its groups' blocks between steps; one whose prompt is all `seq_len`
    tokens holds every layer's blocks for its prefill step, so admitting it needs that much beside
    the others. Contiguous, each reserves `contiguous_bytes(max_len)`.
    """
    if seq_len > max_len:
        raise ValueError(f"seq_len {seq_len} exceeds max_len {max_len}, so a contiguous "
                         "reservation could not hold it; raise max_len")
    price = sequence_price(cfg, layout, seq_len)
    whole_prompts = 0 if budget_bytes < price.full else 1 + (budget_bytes - price.full) // price.held
    return WindowedFit(paged=budget_bytes // price.held, whole_prompts=whole_prompts,
                       contiguous=budget_bytes // contiguous_bytes(cfg, layout, max_len), price=price)


# ---- report lines ----------------------------------------------------------------------------

def format_bytes(n: int) -> str:
    """`309,237,645,312 bytes (288.00 GiB)`: exact for checking, binary units for reading."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n:,} bytes ({n / scale:.2f} {unit})"
    return f"{n:,} bytes"


def layer_ranges(layers: tuple[int, ...]) -> str:
    """`0-4, 6-10, 12-16`: runs of consecutive layers, so 52 of Gemma 3 27B's layers fit a line."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def format_groups(price: SequencePrice, block_size: int, batch: int) -> list[str]:
    """The report's lines for a windowed model: each group's blocks and bytes, the sequence's
    price against every layer full, per token and for the batch."""
    width = max(len(g.group.name) for g in price.groups) + 1
    lines = [f"KV layer groups at {price.tokens:,} tokens, blocks of {block_size} tokens:"]
    for g in price.groups:
        most = g.group.most_blocks(block_size)
        bound = f" (at most {most:,})" if most is not None and most > g.blocks else ""
        lines.append(f"  {g.group.name + ':':<{width}} {len(g.group.layers)} layers ({layer_ranges(g.group.layers)}), "
                     f"{g.blocks:,} blocks each{bound}: {format_bytes(g.bytes)}")
    return lines + [
        f"KV per sequence: {format_bytes(price.held)} held between steps",
        f"  every layer full: {format_bytes(price.full)}, held during its prompt's prefill step (and always "
        f"with --no-hybrid); the windows save {price.saving:.1%}",
        f"KV per token: {_mean(price.held, price.tokens)} bytes on average at {price.tokens:,} tokens "
        f"(every layer full: {_mean(price.full, price.tokens)})",
        f"KV cache: {format_bytes(batch * price.held)}",
        f"  = {batch:,} batch x {price.held:,} bytes per sequence",
    ]


def _mean(total: int, count: int) -> str:
    """`4,032`, or `132,120.58` where the blocks' bytes do not split evenly over the tokens."""
    return f"{total // count:,}" if total % count == 0 else f"{total / count:,.2f}"
