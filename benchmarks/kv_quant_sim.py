"""Which 2-bit KIVI key layout to build: a simulation, `python benchmarks/kv_quant_sim.py [--data python-docs]`.

Questions the engine cannot answer without building each candidate first (issue 12): would keys
quantized *before* RoPE (KVQuant) beat the Hadamard rotation kvserve has, and what would each
cost? HF transformers runs the bundled model with its attention swapped for one that reads
quantized-then-dequantized K/V exactly where kvserve's pool would: for a query at slot t, keys
and values of blocks before t's own block are encoded (KIVI: keys per channel over the block,
values per token in groups of `--group` channels), its own block is exact (the block still
filling, kvserve's staging; a step's own tokens). Everything else follows `kvserve eval`:
windows of 512 tokens, 256 prefilled, perplexity and KL over the other 256 against exact K/V.

Not a cache result: the engine rows in BENCHMARKS.md are. The simulation is checked against
them (the same layouts measured both ways) and printed beside them in BENCHMARKS.md.

Pre-RoPE keys are recovered from HF's post-RoPE keys by the inverse rotation (SmolLM2 uses plain
RoPE, theta from the model config), quantized, and rotated back at their positions: the
decoder of a pre-RoPE cache would do the same for every key it reads, every step.

`--mixed` runs the layouts that spend a few more bits on the key channels that matter most:
per layer and KV head, the `hi` channels with the largest E[q_d^2] * E[range_d^2] (a channel's
share of the q.k error when its step is proportional to its range) get `hi_bits`, the rest 2.
The choice is calibrated once on another text (`--calib`, its last 8 windows) and then fixed,
as a plan file would fix it; the channel list costs nothing per token. Post-RoPE, channels d and
d + D/2 rotate into each other with position, so they are chosen in pairs, and the keys are left
unrotated (a Hadamard would spread the outlier channels the ranking looks for) while the values
are rotated; symmetric values (a scale, no zero-point) pay for more wide channels. The engine
builds the post-RoPE layout (`kv_key_wide_channels`, `kv_symmetric_values`, `kv_rotate_keys`).
"""
from __future__ import annotations

import argparse
import math
from typing import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from kvserve.attention.rotation import rotation_matrix
from kvserve.bench.hf_baseline import load_hf_model
from kvserve.cache.formats.codes import dequantize_asym, quantize_asym
from kvserve.model.llama import RotaryEmbedding
from kvserve.model.loader import default_model_path
from kvserve.texts import load_text


def minmax(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The engine's asymmetric min-max codes along `dim` (fp16 scale and zero-point), decoded."""
    codes, scale, zero = quantize_asym(x, bits, dim)
    return dequantize_asym(codes, scale, zero, dim)


def midrise(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Symmetric codes without a zero-point: levels (c + 1/2) * step, c in [-2^(b-1), 2^(b-1) - 1],
    one fp16 step per slice along `dim` sized so the largest |x| is a level."""
    half = 2 ** (bits - 1)
    step = (x.abs().amax(dim, keepdim=True) / (half - 0.5)).clamp_min(2.0 ** -14).half().float()
    return ((x / step - 0.5).round().clamp(-half, half - 1) + 0.5) * step


def rope_tables(length: int, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own RoPE tables, [length, dim] (both halves of a head share an angle)."""
    rotary = RotaryEmbedding(dim, length, theta)
    return torch.cat([rotary.cos, rotary.cos], -1), torch.cat([rotary.sin, rotary.sin], -1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


class Layout:
    """One candidate: bits per role, keys pre- or post-RoPE, Hadamard or not, exact sinks."""

    def __init__(self, name: str, block: int, group: int, theta: float, rotation: torch.Tensor | None,
                 k_bits: int = 2, v_bits: int = 2, pre_rope: bool = False, sink: bool = False,
                 hi: int = 0, hi_bits: int = 3, importance: dict[int, torch.Tensor] | None = None,
                 pairs: bool = False, v_rotation: torch.Tensor | None = None, v_symmetric: bool = False) -> None:
        self.name, self.block, self.group, self.theta, self.rotation = name, block, group, theta, rotation
        self.v_rotation, self.v_symmetric = v_rotation, v_symmetric
        self.k_bits, self.v_bits, self.pre_rope, self.sink = k_bits, v_bits, pre_rope, sink
        # `hi` channels per KV head at `hi_bits`, chosen from `importance[layer]` [kv_heads, D].
        self.hi, self.hi_bits, self.importance = hi, hi_bits, importance
        # Post-RoPE, channels d and d + D/2 rotate into each other with position: chosen as pairs.
        self.pairs = pairs

    def chosen(self, layer: int, heads: int, dim: int) -> torch.Tensor:
        """[heads, dim] bool: the key channels stored at `hi_bits`."""
        assert self.importance is not None
        imp = self.importance[layer]
        if self.pairs:
            top = (imp[:, :dim // 2] + imp[:, dim // 2:]).topk(self.hi // 2, -1).indices
            top = torch.cat([top, top + dim // 2], -1)
        else:
            top = imp.topk(self.hi, -1).indices
        return torch.zeros(heads, dim, dtype=torch.bool).scatter(1, top, True)

    def bits(self, head_dim: int) -> float:
        """Bits per stored value, K and V averaged: codes, fp16 scale + zero-point per channel and
        block (keys) or per group (values), and the fp16 sink key of each block."""
        keys = self.k_bits + self.hi * (self.hi_bits - self.k_bits) / head_dim + 32 / self.block
        keys += 16 / self.block if self.sink else 0.0
        return (keys + self.v_bits + (16 if self.v_symmetric else 32) / self.group) / 2

    def stored(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """K or q [heads, T, D] post-RoPE -> the basis keys are quantized in."""
        x = t * cos - rotate_half(t) * sin if self.pre_rope else t
        return x if self.rotation is None else x @ self.rotation

    def keys(self, k: torch.Tensor, layer: int) -> torch.Tensor:
        """k [kv_heads, T, D] post-RoPE -> what a query in a later block would read."""
        heads, length, dim = k.shape
        cos, sin = rope_tables(length, dim, self.theta)
        x = self.stored(k, cos, sin)
        full = length // self.block * self.block
        blocks = x[:, :full].unflatten(1, (-1, self.block))  # [H, n, block, D]
        body = blocks[:, :, 1:] if self.sink else blocks  # with a sink, the first key exact, out of the ranges
        if self.k_bits < 16:
            coded = minmax(body, self.k_bits, 2)
            if self.hi and self.importance is not None:
                chosen = self.chosen(layer, heads, dim)[:, None, None, :]
                coded = torch.where(chosen, minmax(body, self.hi_bits, 2), coded)
            blocks = torch.cat([blocks[:, :, :1], coded], 2) if self.sink else coded
        y = torch.cat([blocks.flatten(1, 2), x[:, full:]], 1)
        y = y if self.rotation is None else y @ self.rotation.T
        return y * cos + rotate_half(y) * sin if self.pre_rope else y

    def values(self, v: torch.Tensor) -> torch.Tensor:
        r = self.v_rotation
        x = v if r is None else v @ r
        if self.v_bits < 16:
            grouped = x.unflatten(-1, (-1, self.group))
            x = (midrise if self.v_symmetric else minmax)(grouped, self.v_bits, -1).flatten(-2)
        return x if r is None else x @ r.T


class Simulation:
    def __init__(self, block: int) -> None:
        self.block = block
        self.layout: Layout | None = None
        # While set (calibration), every layer adds its channels' importance here, in `layout`'s basis.
        self.importance: dict[int, torch.Tensor] | None = None

    def attention(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                  **kwargs: object) -> tuple[torch.Tensor, None]:
        """HF's attention interface: q [B, H, T, D], k/v [B, kv_heads, T, D]."""
        length = query.shape[2]
        slot = torch.arange(length)
        causal = slot[None, :] <= slot[:, None]
        encoded = slot[None, :] // self.block < slot[:, None] // self.block  # an earlier block
        group = query.shape[1] // key.shape[1]
        outs = []
        layer = module.layer_idx
        for q, k, v in zip(query.float(), key.float(), value.float()):
            if self.importance is not None and self.layout is not None:
                self.importance[layer] = self.importance.get(layer, 0) + self.channel_importance(q, k)
                kq, vq = k, v
            else:
                kq, vq = (k, v) if self.layout is None else (self.layout.keys(k, layer), self.layout.values(v))
            k, v, kq, vq = (t.repeat_interleave(group, 0) for t in (k, v, kq, vq))
            scores = torch.where(encoded, q @ kq.transpose(1, 2), q @ k.transpose(1, 2)) * scaling
            p = scores.masked_fill(~causal, -math.inf).softmax(-1)
            outs.append(((p * encoded) @ vq + (p * ~encoded) @ v).transpose(0, 1))
        return torch.stack(outs).to(query.dtype), None

    def channel_importance(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """E[q_d^2] over a KV head's query heads times E[range_d^2] over its key blocks: [kv_heads, D]."""
        assert self.layout is not None
        cos, sin = rope_tables(k.shape[1], k.shape[2], self.layout.theta)
        qs, ks = self.layout.stored(q, cos, sin), self.layout.stored(k, cos, sin)
        full = ks.shape[1] // self.block * self.block
        blocks = ks[:, :full].unflatten(1, (-1, self.block))
        blocks = blocks[:, :, 1:] if self.layout.sink else blocks  # the sink is stored apart
        ranges = (blocks.amax(2) - blocks.amin(2)).pow(2).mean(1)
        return qs.unflatten(0, (k.shape[0], -1)).pow(2).mean((1, 2)) * ranges


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=None, help="text spec as kvserve eval takes it (default: WikiText-2)")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--block", type=int, default=64, help="tokens per block (default 64)")
    p.add_argument("--group", type=int, default=64, help="value channels per scale (default 64)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--mixed", action="store_true",
                   help="only the layouts with calibrated higher-bit key channels (pre-RoPE, rotated, exact sink)")
    p.add_argument("--calib", default="python-docs",
                   help="text whose last 8 windows choose the higher-bit channels (default python-docs; "
                        "pass the other text than --data)")
    args = p.parse_args()

    sim = Simulation(args.block)
    AttentionInterface.register("kvserve_sim", sim.attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("kvserve_sim", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model, tok = load_hf_model(str(default_model_path()), getattr(torch, args.dtype))
    model.config._attn_implementation = "kvserve_sim"
    cfg = model.config
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    dim = cfg.hidden_size // cfg.num_attention_heads
    hadamard = rotation_matrix("hadamard", dim, 0)

    ids = tok.encode(load_text(args.data).text[:40 * 512 * args.windows], add_special_tokens=False)
    windows = torch.tensor([ids[i * 512:(i + 1) * 512] for i in range(args.windows)])

    def logprobs() -> torch.Tensor:
        return model(windows).logits[:, 255:-1].float().log_softmax(-1)

    ref = logprobs()
    targets = windows[:, 256:, None]
    base = -ref.gather(-1, targets).mean()

    def layout(name: str, **kw: object) -> Layout:
        rot = kw.pop("rotated", False)
        v_rot = kw.pop("values_rotated", rot)
        return Layout(name, args.block, args.group, theta, hadamard if rot else None,
                      v_rotation=hadamard if v_rot else None, **kw)

    if args.mixed:
        # The channels are chosen once, from another text, in the basis the keys are stored in.
        calib_ids = tok.encode(load_text(args.calib).text[-40 * 512 * 8:], add_special_tokens=False)
        calib = torch.tensor([calib_ids[i * 512:(i + 1) * 512] for i in range(8)])

        def calibrated(**kw: object) -> dict[str, object]:
            sim.layout, sim.importance = layout("probe", **kw), {}
            for window in calib.split(2):
                model(window)
            importance, sim.importance, sim.layout = sim.importance, None, None
            return {**kw, "importance": importance}

        pre = calibrated(rotated=True, pre_rope=True, sink=True)
        post = calibrated(values_rotated=True, sink=True)
        layouts = [
            layout("pre-RoPE, rotated, exact sink, 8 key channels per head 3-bit", hi=8, hi_bits=3, **pre),
            layout("post-RoPE, keys not rotated, values rotated, exact sink (all keys 2-bit)",
                   values_rotated=True, sink=True),
            layout("... 16 key channels (8 RoPE pairs) per head 3-bit", hi=16, hi_bits=3, pairs=True, **post),
            layout("... 24 key channels (12 RoPE pairs) 3-bit, values symmetric", hi=24, hi_bits=3, pairs=True,
                   v_symmetric=True, **post),
            layout("... 16 key channels 3-bit, no sink", hi=16, hi_bits=3, pairs=True, **{**post, "sink": False}),
        ]
        return run_layouts(sim, layouts, logprobs, ref, targets, base, dim,
                           f"{load_text(args.data).name}: channels calibrated on {load_text(args.calib).name}")
    layouts = [
        layout("post-RoPE"), layout("post-RoPE, rotated", rotated=True),
        layout("pre-RoPE", pre_rope=True), layout("pre-RoPE, rotated", rotated=True, pre_rope=True),
        layout("post-RoPE, exact sink", sink=True), layout("post-RoPE, rotated, exact sink", rotated=True, sink=True),
        layout("pre-RoPE, exact sink", pre_rope=True, sink=True),
        layout("pre-RoPE, rotated, exact sink", rotated=True, pre_rope=True, sink=True),
        layout("rotated, exact sink: keys 2-bit, values exact", rotated=True, sink=True, v_bits=16),
        layout("rotated, exact sink: keys exact, values 2-bit", rotated=True, sink=True, k_bits=16),
        layout("rotated, exact sink: keys 3-bit", rotated=True, sink=True, k_bits=3),
    ]
    run_layouts(sim, layouts, logprobs, ref, targets, base, dim,
                f"{load_text(args.data).name}: {args.windows} windows x 512, block {args.block}, value groups "
                f"{args.group}, {args.dtype}; exact K/V ppl {base.exp().item():.3f}")


def run_layouts(sim: Simulation, layouts: list[Layout], logprobs: Callable[[], torch.Tensor], ref: torch.Tensor,
                targets: torch.Tensor, base: torch.Tensor, dim: int, title: str) -> None:
    print(f"{title}\n\n| 2-bit KIVI layout (simulated) | bits / value | ppl vs exact | KL |\n|---|---|---|---|")
    for lay in layouts:
        sim.layout = lay
        lp = logprobs()
        sim.layout = None
        ppl = (-lp.gather(-1, targets).mean() - base).exp().item() - 1
        kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        print(f"| {lay.name} | {lay.bits(dim):.4g} | {100 * ppl:+.2f}% | {kl:.4f} |", flush=True)


if __name__ == "__main__":
    main()
