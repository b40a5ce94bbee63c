"""KV-cache memory planning: bytes per token, batch totals, what fits a budget, paging's savings.

Everything here is arithmetic on a model's shape; no weights are loaded. Every layer keeps one
K and one V vector of `num_kv_heads x head_dim` elements per token, so a batch's cache is

    2 x batch x layers x kv_heads x head_dim x seq_len x bytes_per_element

A model with sliding-window layers (Gemma 3, Mistral v0.1) is priced as the engine's hybrid KV
cache holds it: a sliding layer keeps only the blocks its window sees, so its cost stops growing at
the window; the per-group arithmetic is kv_group_pricing.py's. `--no-hybrid` prices every layer
full, as the engine with `disable_hybrid_kv_cache`.

`kvserve memory` prints these figures; the functions below and kv_group_pricing's are its Python
interface.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kvserve.arg_types import at_least, number
from kvserve.cache.kv_plan import plan_path
from kvserve.config import parse_bytes
from kvserve.diagnostics.kv_group_pricing import (KVLayout, bytes_per_element, format_bytes, format_groups, kv_dtypes,
                                                  sequence_price, windowed, windowed_fit)
from kvserve.measure import request_lengths
from kvserve.model.config import PRESETS, ModelConfig


# ---- model shapes ----------------------------------------------------------------------------

def model_shape(source: str | Path) -> ModelConfig:
    """A model's shape from a preset name, a config.json (or its directory) or a .gguf file."""
    if isinstance(source, str) and source in PRESETS:
        return PRESETS[source]
    path = Path(source)
    if path.suffix == ".gguf":
        return gguf_shape(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{source}: not a preset ({', '.join(PRESETS)}), a config.json, "
                                "a directory holding one, or a .gguf file")
    try:
        return ModelConfig.from_json(path)
    except KeyError as err:
        raise ValueError(f"{path}: not a Llama-style config.json (it has no {err})") from None


def gguf_shape(path: Path) -> ModelConfig:
    """A GGUF model's shape from its metadata alone; the tensors are never read."""
    # Imported here so that preset and config.json plans load neither gguf nor the model code.
    import gguf

    from kvserve.model.gguf_convert import gguf_field as _gguf_field
    from kvserve.model.gguf_gemma3 import GEMMA3_ARCH, gemma3_config

    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    reader = gguf.GGUFReader(path)
    arch = _gguf_field(reader, "general.architecture")
    if arch == GEMMA3_ARCH:  # its sliding layers are llama.cpp's fixed pattern, which gemma3_config spells out
        return ModelConfig.from_hf_dict(gemma3_config(reader))

    def field(key: str, default: int | None = None) -> int:
        value = _gguf_field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path}: the GGUF metadata has no {arch}.{key}")
        return int(value)

    heads = field("attention.head_count")
    hidden = field("embedding_length")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    # Fields the KV cache does not depend on (RoPE base, norm epsilon, ...) keep their defaults.
    return ModelConfig(
        vocab_size=len(tokens.data) if tokens is not None else field("vocab_size"),
        hidden_size=hidden,
        intermediate_size=field("feed_forward_length"),
        num_layers=field("block_count"),
        num_heads=heads,
        num_kv_heads=field("attention.head_count_kv", heads),
        # key_length is the stored K width; files that omit it give the rotary width, or neither.
        head_dim=field("attention.key_length", field("rope.dimension_count", hidden // heads)),
        max_position=field("context_length", 2048),
    )


def explicit_shape(layers: int, kv_heads: int, head_dim: int, heads: int | None = None,
                   max_position: int = 2048) -> ModelConfig:
    """A shape from the numbers the KV cache depends on; `heads` defaults to `kv_heads` (MHA)."""
    heads = heads or kv_heads
    hidden = heads * head_dim
    # The vocabulary and MLP widths never enter KV arithmetic; they only have to pass validation.
    return ModelConfig(vocab_size=1, hidden_size=hidden, intermediate_size=4 * hidden,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       max_position=max_position)


def attention_kind(cfg: ModelConfig) -> str:
    if cfg.num_kv_heads == cfg.num_heads:
        return "MHA"
    return "MQA" if cfg.num_kv_heads == 1 else "GQA"


# ---- sizes -----------------------------------------------------------------------------------

def kv_bytes(cfg: ModelConfig, layout: KVLayout, batch: int, seq_len: int) -> int:
    """2 x batch x layers x kv_heads x head_dim x seq_len x bytes per element.

    Exact for byte-sized formats; a fractional total (int4 groups that split unevenly) is
    rounded up, since memory comes in whole bytes.
    """
    elements = 2 * batch * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * seq_len
    return math.ceil(elements * bytes_per_element(cfg, layout))


def kv_bytes_per_token(cfg: ModelConfig, layout: KVLayout) -> int:
    return kv_bytes(cfg, layout, 1, 1)


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass(frozen=True)
class Fit:
    paged: int  # sequences when memory is handed out block by block as tokens arrive
    contiguous: int  # sequences when each one reserves max_len tokens up front
    num_blocks: int  # blocks of block_size tokens the budget holds
    block_bytes: int


def sequences_that_fit(cfg: ModelConfig, layout: KVLayout, budget_bytes: int, seq_len: int,
                       max_len: int | None = None) -> Fit:
    """How many `seq_len`-token sequences a budget holds, paged and contiguous.

    Paged, a sequence takes ceil(seq_len / block_size) blocks; contiguous, it reserves
    `max_len` tokens (default: the model's context), as an engine that cannot grow a
    sequence's cache must.
    """
    max_len = cfg.max_position if max_len is None else max_len
    block_size = layout.block_size
    if seq_len < 1 or block_size < 1:
        raise ValueError(f"seq_len ({seq_len}) and block_size ({block_size}) must be positive")
    if seq_len > max_len:
        raise ValueError(f"seq_len {seq_len} exceeds max_len {max_len}, so a contiguous "
                         "reservation could not hold it; raise max_len")
    block_bytes = kv_bytes(cfg, layout, 1, block_size)
    num_blocks = budget_bytes // block_bytes
    return Fit(paged=num_blocks // _blocks(seq_len, block_size),
               contiguous=budget_bytes // kv_bytes(cfg, layout, 1, max_len),
               num_blocks=num_blocks, block_bytes=block_bytes)


def paging_waste(lengths: list[int], max_len: int, block_size: int) -> tuple[float, float]:
    """(contiguous, paged) fraction of allocated token slots that hold no token.

    Contiguous allocation reserves `max_len` slots per sequence; paging allocates whole blocks,
    so only the last block of each sequence can be partly empty.
    """
    if not lengths:
        raise ValueError("paging_waste needs at least one length")
    if min(lengths) < 1 or max(lengths) > max_len:
        raise ValueError(f"lengths must lie in [1, {max_len}], got {min(lengths)}..{max(lengths)}")
    used = sum(lengths)
    paged = sum(_blocks(n, block_size) for n in lengths) * block_size
    return 1 - used / (len(lengths) * max_len), 1 - used / paged


def lognormal_lengths(num_seqs: int, median: int, sigma: float, max_len: int, seed: int = 0) -> list[int]:
    """Sequence lengths in [1, max_len] with the long tail real requests show; seeded, so repeatable."""
    rng = np.random.default_rng(seed)
    return request_lengths.lognormal_lengths(rng, median, sigma, num_seqs, 1, max_len).tolist()


@dataclass(frozen=True)
class AttentionKind:
    name: str  # "MHA", "GQA" or "MQA"
    kv_heads: int
    bytes_per_token: int


def _gqa_kv_heads(cfg: ModelConfig) -> int | None:
    if 1 < cfg.num_kv_heads < cfg.num_heads:
        return cfg.num_kv_heads
    # MHA and MQA models have no grouping of their own: show 8 KV heads, the usual choice
    # (Llama-2-70B, Llama-3, Mistral), or the largest smaller count that divides the heads
    # evenly. None when no count does (71 heads, say): there is no GQA form to show.
    return next((g for g in range(min(8, cfg.num_heads - 1), 1, -1) if cfg.num_heads % g == 0), None)


def compare_attention_kinds(cfg: ModelConfig, layout: KVLayout = KVLayout()) -> list[AttentionKind]:
    """The same model with MHA (a KV head per query head), GQA and MQA (one KV head)."""
    counts = [("MHA", cfg.num_heads), ("GQA", _gqa_kv_heads(cfg)), ("MQA", 1)]
    return [AttentionKind(name, kv, kv_bytes_per_token(replace(cfg, num_kv_heads=kv), layout))
            for name, kv in counts if kv is not None]


# ---- report ----------------------------------------------------------------------------------

def batch_bytes(cfg: ModelConfig, layout: KVLayout, batch: int, seq_len: int, hybrid: bool = True) -> int:
    """A batch's KV cache: `kv_bytes`, or for a windowed model with the hybrid cache, the whole
    blocks its sequences hold between steps."""
    if windowed(cfg, hybrid):
        return batch * sequence_price(cfg, layout, seq_len).held
    return kv_bytes(cfg, layout, batch, seq_len)


def format_plan(cfg: ModelConfig, layout: KVLayout, batch: int, seq_len: int, *,
                name: str = "model", budget_bytes: int | None = None,
                max_len: int | None = None, lengths: list[int] | None = None,
                compare: bool = False, hybrid: bool = True) -> str:
    """The human-readable plan `kvserve memory` prints; `hybrid` False prices every layer full."""
    max_len = cfg.max_position if max_len is None else max_len
    block_size = layout.block_size
    element = bytes_per_element(cfg, layout)
    window = (f", sliding window {cfg.sliding_window:,} on {len(cfg.sliding_layers)} of {cfg.num_layers} layers"
              if cfg.sliding_layers else "")
    lines = [
        f"Model: {name}: {cfg.num_layers} layers, {cfg.num_heads} heads, {cfg.num_kv_heads} KV heads "
        f"({attention_kind(cfg)}), head_dim {cfg.head_dim}{window}",
        f"KV dtype: {layout.describe()}, {float(element):g} bytes per element (scales included)",
    ]
    if windowed(cfg, hybrid):
        lines += format_groups(sequence_price(cfg, layout, seq_len), block_size, batch)
    else:
        lines += [
            f"KV per token: {format_bytes(kv_bytes_per_token(cfg, layout))}",
            f"KV cache: {format_bytes(kv_bytes(cfg, layout, batch, seq_len))}",
            f"  = 2 x {batch:,} batch x {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x "
            f"{cfg.head_dim} head_dim x {seq_len:,} tokens x {float(element):g} bytes",
        ]
        if cfg.sliding_layers:
            lines.append("  (--no-hybrid: every layer holds every block; the windows only mask)")
    if budget_bytes is not None:
        lines.append(f"Sequences of {seq_len:,} tokens that fit {format_bytes(budget_bytes)}:")
        fit = sequences_that_fit(cfg, layout, budget_bytes, seq_len, max_len)
        every_block = (f"{fit.paged:,} ({fit.num_blocks:,} blocks of {block_size} tokens, "
                       f"{_blocks(seq_len, block_size):,} blocks each)")
        if windowed(cfg, hybrid):
            held = windowed_fit(cfg, layout, budget_bytes, seq_len, max_len)
            lines += [
                f"  paged:      {held.paged:,} held between steps ({held.price.held:,} bytes each); "
                f"{held.whole_prompts:,} if each arrives as one {seq_len:,}-token prompt (its prefill step "
                f"holds {held.price.full:,} bytes; one at a time)",
                f"  paged, every layer full (--no-hybrid): {every_block}",
                f"  contiguous: {held.contiguous:,} (each reserving {max_len:,} tokens in full layers, "
                f"its window in sliding ones)",
            ]
        else:
            lines += [f"  paged:      {every_block}",
                      f"  contiguous: {fit.contiguous:,} (each reserving {max_len:,} tokens)"]
    if lengths is not None:
        contiguous, paged = paging_waste(lengths, max_len, block_size)
        lines += [
            f"Waste over {len(lengths):,} sequences (median length {statistics.median(lengths):g}, "
            f"longest {max(lengths):,}), as a share of allocated token slots:",
            f"  contiguous: {contiguous:6.1%} (each reserving {max_len:,} tokens)",
            f"  paged:      {paged:6.1%} (blocks of {block_size} tokens)",
        ]
    if compare:
        kinds = compare_attention_kinds(cfg, layout)
        mha = kinds[0].bytes_per_token
        lines += [f"Attention kinds, {layout.dtype}, batch {batch:,} x {seq_len:,} tokens:",
                  "  kind  KV heads   bytes/token    bytes for the batch  MHA/this"]
        for kind in kinds:
            total = batch_bytes(replace(cfg, num_kv_heads=kind.kv_heads), layout, batch, seq_len, hybrid)
            own = "  <- this model" if kind.kv_heads == cfg.num_kv_heads else ""
            lines.append(f"  {kind.name}   {kind.kv_heads:>8}  {kind.bytes_per_token:>12,}  {total:>21,}"
                         f"  {mha / kind.bytes_per_token:>8g}{own}")
        if len(kinds) < 3:
            lines.append(f"  (no GQA: no KV head count from 2 to 8 divides {cfg.num_heads} heads evenly)")
    return "\n".join(lines)


# ---- command line ----------------------------------------------------------------------------

_EXAMPLES = """examples:
  kvserve memory --preset gpt3-175b --batch 32 --seq-len 2048 --dtype fp16
  kvserve memory --preset llama-2-70b --budget 80GiB --seq-len 1000 --compare-attention
  kvserve memory --preset gemma-3-1b --seq-len 32768 --budget 4GiB [--no-hybrid]
  kvserve memory --config path/to/model --lengths-median 300 --max-len 4096
  kvserve memory --layers 32 --kv-heads 8 --heads 32 --head-dim 128 --dtype int4 --group-size 64
"""


def _kv_dtype(text: str) -> str:
    if text not in kv_dtypes() and plan_path(text) is None:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(kv_dtypes())} or plan:PATH, got {text!r}")
    return text


def _byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a size; use e.g. 80GiB, 512MiB or 1000000") from None


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `kvserve memory` on the top-level command's subparsers."""
    p = sub.add_parser(
        "memory", help="plan KV-cache memory: bytes per token and in total, budget fit, paging waste",
        description="Works out a model's KV-cache size from its shape alone (no weights are loaded): "
                    "bytes per token and for a batch, how many sequences fit a memory budget with "
                    "paged and with contiguous allocation, and how much of each allocation a spread "
                    "of sequence lengths leaves empty.",
        epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = p.add_argument_group("model (give exactly one of --preset, --config, --gguf, --layers)")
    source = model.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=sorted(PRESETS), help="a built-in model shape")
    source.add_argument("--config", help="a Hugging Face config.json, or the model directory holding it")
    source.add_argument("--gguf", help="a .gguf file (only its metadata is read)")
    source.add_argument("--layers", type=at_least(1), help="explicit shape: layers (with --kv-heads, --head-dim)")
    model.add_argument("--kv-heads", type=at_least(1), help="explicit shape: K/V heads per layer")
    model.add_argument("--head-dim", type=at_least(1), help="explicit shape: elements per head")
    model.add_argument("--heads", type=at_least(1),
                       help="explicit shape: query heads, for --compare-attention (default: --kv-heads)")

    cache = p.add_argument_group("cache")
    cache.add_argument("--dtype", default="fp16", type=_kv_dtype, metavar="{" + ",".join(kv_dtypes()) + "} | plan:PATH",
                       help="KV format, as the engine's --kv-cache-dtype, or a per-layer plan file (default fp16)")
    cache.add_argument("--group-size", type=at_least(1), default=None,
                       help="channels per fp16 scale and zero-point for int4, kivi values and outlier "
                            "(default 32)")
    cache.add_argument("--exact-sink", action="store_true",
                       help="kivi keys keep each block's first key in fp16, as the engine's --kv-exact-sink "
                            "(16 / block size more bits per key value; kivi2_mix_unrope and kivi2_vq: the first "
                            "key and value in int8, 8 / block size bits each)")
    cache.add_argument("--key-wide-channels", type=int, default=0,
                       help="kivi keys: channels per KV head with one bit more, as the engine's "
                            "--kv-key-wide-channels (a multiple of 8; default 0)")
    cache.add_argument("--symmetric-values", action="store_true",
                       help="kivi values without zero-points, as the engine's --kv-symmetric-values")
    cache.add_argument("--batch", type=at_least(1), default=1, help="sequences in the batch (default 1)")
    cache.add_argument("--seq-len", type=at_least(1), default=2048, help="tokens per sequence (default 2048)")
    cache.add_argument("--block-size", type=at_least(1), default=16, help="tokens per paged block (default 16)")
    cache.add_argument("--no-hybrid", action="store_true",
                       help="price every layer full, as the engine with disable_hybrid_kv_cache (sliding windows "
                            "then only mask); by default a sliding layer holds only its window's blocks")
    cache.add_argument("--max-len", type=at_least(1), default=None,
                       help="tokens a contiguous cache reserves per sequence (default: the model's context; "
                            "--seq-len for an explicit shape)")

    plan = p.add_argument_group("planning")
    plan.add_argument("--budget", type=_byte_size, default=None,
                      help="KV memory to fill, e.g. 80GiB: prints how many --seq-len sequences fit")
    plan.add_argument("--tensor-parallel-size", type=at_least(1), default=1,
                      help="plan one rank of an engine split over this many (each rank's pool holds only its "
                           "KV heads; --budget is then per rank); default 1")
    plan.add_argument("--compare-attention", action="store_true",
                      help="show the same model with MHA, GQA and MQA side by side")
    plan.add_argument("--lengths-median", type=at_least(1), default=None,
                      help="estimate contiguous vs paged waste over lognormal lengths with this median")
    plan.add_argument("--lengths-sigma", type=number(at_least=0), default=0.8,
                      help="lognormal spread of those lengths (default 0.8)")
    plan.add_argument("--num-seqs", type=at_least(1), default=1000,
                      help="lengths to draw for the waste estimate (default 1000)")
    plan.add_argument("--seed", type=int, default=0, help="seed for the drawn lengths (default 0)")
    p.set_defaults(func=run)


def _shape_from_args(args: argparse.Namespace) -> tuple[str, ModelConfig]:
    explicit = (args.kv_heads, args.head_dim, args.heads)
    if args.layers is None:
        if any(v is not None for v in explicit):
            raise ValueError("--kv-heads, --head-dim and --heads describe an explicit shape; add --layers")
        if args.preset:
            return args.preset, model_shape(args.preset)
        option, path = ("--config", args.config) if args.config else ("--gguf", args.gguf)
        try:
            return path, model_shape(path) if args.config else gguf_shape(Path(path))
        except FileNotFoundError:
            raise
        except (ValueError, OSError, KeyError) as err:  # a file of another kind
            raise ValueError(f"{option} {path}: not a model's {'config' if args.config else 'GGUF'} "
                             f"({type(err).__name__}: {err})") from None
    if args.kv_heads is None or args.head_dim is None:
        raise ValueError("--layers needs --kv-heads and --head-dim too")
    cfg = explicit_shape(args.layers, args.kv_heads, args.head_dim, args.heads,
                         max_position=args.max_len or args.seq_len)
    return "explicit shape", cfg


def run(args: argparse.Namespace) -> None:
    name, cfg = _shape_from_args(args)
    if args.tensor_parallel_size > 1:
        from kvserve.distributed.sharding import shard_config, shard_of

        shard = shard_of(cfg, 0, args.tensor_parallel_size)
        note = (f"each of its KV heads replicated on {args.tensor_parallel_size // cfg.num_kv_heads} ranks"
                if shard.replicated_kv else f"the most of any rank; {cfg.num_kv_heads} KV heads in all")
        print(f"Per rank of tensor_parallel_size {args.tensor_parallel_size}: rank 0 holds {len(shard.kv_heads)} "
              f"KV head(s) ({note}) and {len(shard.q_heads)} query heads")
        cfg = shard_config(cfg, shard)
    max_len = args.max_len or cfg.max_position
    if args.budget is not None and args.seq_len > max_len:
        raise ValueError(f"--seq-len {args.seq_len} exceeds --max-len {max_len} (the model's context length "
                         f"unless given), so a contiguous reservation could not hold it: raise --max-len or "
                         f"lower --seq-len")
    lengths = None
    if args.lengths_median is not None:
        lengths = lognormal_lengths(args.num_seqs, args.lengths_median, args.lengths_sigma, max_len, args.seed)
    layout = KVLayout(args.dtype, args.group_size, args.block_size, args.exact_sink, args.key_wide_channels,
                      args.symmetric_values)
    print(format_plan(cfg, layout, args.batch, args.seq_len, name=name, budget_bytes=args.budget, max_len=max_len,
                      lengths=lengths, compare=args.compare_attention, hybrid=not args.no_hybrid))


def main(argv: list[str] | None = None) -> None:
    """`python -m kvserve.diagnostics.memory_planner ARGS` runs `kvserve memory ARGS`."""
    parser = argparse.ArgumentParser(prog="kvserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["memory", *(sys.argv[1:] if argv is None else argv)])
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"kvserve memory: error: {err}")


if __name__ == "__main__":
    main()
