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
"""
from __future__ import annotations

import argparse
import math

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from kvserve.attention.rotation import rotation_matrix
from kvserve.bench.hf_baseline import load_hf_model
from kvserve.cache.kv_format import _dequantize_asym, _quantize_asym
from kvserve.model.llama import RotaryEmbedding
from kvserve.model.loader import default_model_path
from kvserve.texts import load_text


def minmax(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The engine's asymmetric min-max codes along `dim` (fp16 scale and zero-point), decoded."""
    codes, scale, zero = _quantize_asym(x, bits, dim)
    return _dequantize_asym(codes, scale, zero, dim)


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
                 k_bits: int = 2, v_bits: int = 2, pre_rope: bool = False, sink: bool = False) -> None:
        self.name, self.block, self.group, self.theta, self.rotation = name, block, group, theta, rotation
        self.k_bits, self.v_bits, self.pre_rope, self.sink = k_bits, v_bits, pre_rope, sink

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        """k [kv_heads, T, D] post-RoPE -> what a query in a later block would read."""
        heads, length, dim = k.shape
        cos, sin = rope_tables(length, dim, self.theta)
        x = k * cos - rotate_half(k) * sin if self.pre_rope else k
        x = x if self.rotation is None else x @ self.rotation
        full = length // self.block * self.block
        blocks = x[:, :full].unflatten(1, (-1, self.block))  # [H, n, block, D]
        if self.k_bits < 16 and self.sink:  # the first key exact, out of the ranges
            blocks = torch.cat([blocks[:, :, :1], minmax(blocks[:, :, 1:], self.k_bits, 2)], 2)
        elif self.k_bits < 16:
            blocks = minmax(blocks, self.k_bits, 2)
        y = torch.cat([blocks.flatten(1, 2), x[:, full:]], 1)
        y = y if self.rotation is None else y @ self.rotation.T
        return y * cos + rotate_half(y) * sin if self.pre_rope else y

    def values(self, v: torch.Tensor) -> torch.Tensor:
        x = v if self.rotation is None else v @ self.rotation
        if self.v_bits < 16:
            x = minmax(x.unflatten(-1, (-1, self.group)), self.v_bits, -1).flatten(-2)
        return x if self.rotation is None else x @ self.rotation.T


class Simulation:
    def __init__(self, block: int) -> None:
        self.block = block
        self.layout: Layout | None = None

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
        for q, k, v in zip(query.float(), key.float(), value.float()):
            kq, vq = (k, v) if self.layout is None else (self.layout.keys(k), self.layout.values(v))
            k, v, kq, vq = (t.repeat_interleave(group, 0) for t in (k, v, kq, vq))
            scores = torch.where(encoded, q @ kq.transpose(1, 2), q @ k.transpose(1, 2)) * scaling
            p = scores.masked_fill(~causal, -math.inf).softmax(-1)
            outs.append(((p * encoded) @ vq + (p * ~encoded) @ v).transpose(0, 1))
        return torch.stack(outs).to(query.dtype), None


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=None, help="text spec as kvserve eval takes it (default: WikiText-2)")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--block", type=int, default=64, help="tokens per block (default 64)")
    p.add_argument("--group", type=int, default=64, help="value channels per scale (default 64)")
    p.add_argument("--dtype", default="bfloat16")
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
        return Layout(name, args.block, args.group, theta, hadamard if rot else None, **kw)

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
    print(f"{load_text(args.data).name}: {args.windows} windows x 512, block {args.block}, value groups "
          f"{args.group}, {args.dtype}; exact K/V ppl {base.exp().item():.3f}\n")
    print("| 2-bit KIVI layout (simulated) | ppl vs exact | KL |\n|---|---|---|")
    for lay in layouts:
        sim.layout = lay
        lp = logprobs()
        sim.layout = None
        ppl = (-lp.gather(-1, targets).mean() - base).exp().item() - 1
        kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        print(f"| {lay.name} | {100 * ppl:+.2f}% | {kl:.4f} |", flush=True)


if __name__ == "__main__":
    main()
