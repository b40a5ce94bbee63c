"""Start-up calibration: per-head fp8 scales (`kv_fp8_scales="head"`: the largest |K| and |V|
each layer's KV heads store) and the KIVI key channels that get a bit more
(`kv_key_wide_channels`: those with the largest E[q_d^2] * E[range_d^2], a channel's share of
the q.k error when its quantization step is proportional to its range) and the fitted (fp8,
int8) keys' offset, weight and spread (each KV head's key mean, its queries' second moment and
its keys' largest deviation from that mean per channel), measured once by running the model over
the first `kv_calibration_tokens` tokens of `kv_calibration_data`.

The model runs as it will serve (same attention path, RoPE and rotation) into a small dense pool
of its own, and the maxima are read from those pages, so the scales cover exactly what the
compressed pages will be asked to hold. The default text ships with kvserve and is read by no
evaluation (texts.py), so calibrated layouts are judged on text they were not fitted to; a model
without a tokenizer (random test models) reads seeded random ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvserve.attention import StepAttention, StepMetadata
from kvserve.attention.rotation import KVRotation
from kvserve.attention.torch_sdpa import SDPAMetadata, TorchSDPABackend
from kvserve.cache.formats import KVFormat
from kvserve.cache.formats.absmax import HeadScaleFormat
from kvserve.cache.formats.block_rope import BlockRope
from kvserve.cache.formats.fitted import FittedFormat
from kvserve.cache.formats.kivi import ChannelFormat, MixedChannelFormat
from kvserve.cache.formats.unroped import UnropedChannelFormat
from kvserve.cache.kv_pool import KVPool
from kvserve.cache.quantized_pool import LayerFormats
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.ops import Ops
from kvserve.texts import load_text

_CHARS_PER_TOKEN = 8  # generous: a slice this many characters per token always holds enough tokens


def calibration_tokens(tokenizer: Any, vocab_size: int, num_tokens: int, seed: int, data: str) -> list[int]:
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab_size, (num_tokens,), generator=g).tolist()
    ids = tokenizer.encode(load_text(data, num_tokens * _CHARS_PER_TOKEN, "kv_calibration_data").text)
    if len(ids) < num_tokens:
        raise ValueError(f"kv_calibration_tokens: {num_tokens} tokens asked, kv_calibration_data {data!r} "
                         f"holds {len(ids)}")
    return ids[:num_tokens]


@dataclass(frozen=True)
class KVStats:
    """What start-up calibration measures, per layer and KV head."""
    amax: torch.Tensor  # [layers, 2 (K, V), kv_heads]: max |x| over the tokens and channels stored
    key_importance: torch.Tensor  # [layers, kv_heads, D]: E[q_d^2] over the head's queries * E[range_d^2]
    key_mean: torch.Tensor  # [layers, kv_heads, D]: E[k_d] over the tokens stored
    key_spread: torch.Tensor  # [layers, kv_heads, D]: max |k_d - E[k_d]| over the tokens stored
    query_moment: torch.Tensor  # [layers, kv_heads, D, D]: E[q q^T] over the head's queries
    # key_importance of the keys turned back by their offset in the block (UnropedChannelFormat), with
    # E[q_d^2] averaged over each RoPE pair (their angle to the query varies with the offset), and
    # each layer's RoPE angles at those offsets.
    key_importance_unroped: torch.Tensor  # [layers, kv_heads, D]
    block_ropes: tuple[BlockRope, ...]  # one a layer

    def heads(self, kv_heads: list[int]) -> "KVStats":
        return KVStats(self.amax[:, :, kv_heads], self.key_importance[:, kv_heads], self.key_mean[:, kv_heads],
                       self.key_spread[:, kv_heads], self.query_moment[:, kv_heads],
                       self.key_importance_unroped[:, kv_heads], self.block_ropes)


class _QueryEnergy(TorchSDPABackend):
    """The reference backend, noting each layer's sum of q q^T over tokens [heads, D, D] as it
    passes (in the basis the keys are stored in): the one thing calibration needs that no page holds."""

    def __init__(self, pool: KVPool, num_heads: int) -> None:
        super().__init__(pool, num_heads)
        self.moment: dict[int, torch.Tensor] = {}

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SDPAMetadata,
                scale: float) -> torch.Tensor:
        q32 = q.float()  # [tokens, heads, D]
        self.moment[layer] = torch.einsum("nhd,nhe->hde", q32, q32)
        return super().forward(layer, q, k, v, meta, scale)


def _range_energy(keys: torch.Tensor, block_size: int, skip_first: bool) -> torch.Tensor:
    """keys [n, H, D] -> E[range_d^2] over the whole blocks of `block_size` tokens (the ranges a
    KIVI block's channel codes span; its first key left out with exact sinks) [H, D]."""
    block = min(block_size, len(keys))
    blocks = keys[:len(keys) // block * block].unflatten(0, (-1, block))
    blocks = blocks[:, 1:] if skip_first and block > 1 else blocks
    return (blocks.amax(1) - blocks.amin(1)).square().mean(0)


def _block_rope(model: LlamaForCausalLM, layer: int, block_size: int) -> BlockRope:
    cos, sin = model.model.rotary.tables(local=model.config.layer_windows[layer] is not None)
    return BlockRope(cos[:block_size].float().cpu(), sin[:block_size].float().cpu())


def _unroped(keys: torch.Tensor, rope: BlockRope, block_size: int) -> torch.Tensor:
    """keys [n, H, D] of one sequence, each block's turned back by its offset (the last may be partial)."""
    return torch.cat([rope.unrotate(block) for block in keys.split(block_size)])


@torch.inference_mode()
def measure_kv_stats(model: LlamaForCausalLM, ops: Ops, token_ids: list[int], rotation: KVRotation | None,
                     dtype: torch.dtype, device: torch.device, block_size: int = 16,
                     exact_sink: bool = False) -> KVStats:
    """Runs `token_ids` as one prompt into a dense pool of its own. `block_size` and
    `exact_sink`: the blocks whose channel ranges `key_importance` averages."""
    cfg = model.config
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    pool = KVPool(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    step = StepMetadata.build([n], [n], [list(range(num_blocks))], block_size, device)
    probe = _QueryEnergy(pool, cfg.num_heads)
    attention = StepAttention.of(probe, step, None, None if rotation is None else rotation.to(device))
    model(torch.tensor(token_ids, device=device), attention, torch.tensor([n - 1], device=device), ops)
    pages = [[p.flatten(0, 1)[:n].float() for p in layer] for layer in pool.layers]
    amax = torch.stack([torch.stack([p.abs().amax((0, 2)) for p in layer]) for layer in pages])
    # Each KV head's queries: the query heads of its GQA group together.
    moment = torch.stack([(probe.moment[i] / n).unflatten(0, (cfg.num_kv_heads, -1)).mean(1)
                          for i in range(len(pages))])
    energy = moment.diagonal(dim1=-2, dim2=-1)
    importance = torch.stack([energy[i] * _range_energy(k, block_size, exact_sink) for i, (k, _) in enumerate(pages)])
    key_mean = torch.stack([k.mean(0) for k, _ in pages])
    key_spread = torch.stack([(k - k.mean(0)).abs().amax(0) for k, _ in pages])
    ropes = tuple(_block_rope(model, i, block_size) for i in range(len(pages)))
    pair_energy = (energy + energy.roll(cfg.head_dim // 2, -1)) / 2
    unroped = torch.stack([pair_energy[i] * _range_energy(_unroped(k, ropes[i], block_size), block_size,
                                                          exact_sink) for i, (k, _) in enumerate(pages)])
    return KVStats(amax.cpu(), importance.cpu(), key_mean.cpu(), key_spread.cpu(), moment.cpu(), unroped.cpu(), ropes)


def _calibrated(fmt: KVFormat, stats: KVStats, layer: int, role: int) -> KVFormat:
    """`fmt` given this layer's statistics, where it asks for them (`calibrated_per_layer`)."""
    if not fmt.calibrated_per_layer:
        return fmt
    if isinstance(fmt, HeadScaleFormat):
        return fmt.calibrated(stats.amax[layer, role])
    if isinstance(fmt, UnropedChannelFormat):
        return fmt.calibrated(stats.key_importance_unroped[layer], stats.block_ropes[layer])
    if isinstance(fmt, (ChannelFormat, MixedChannelFormat)):
        return fmt.calibrated(stats.key_importance[layer])
    if isinstance(fmt, FittedFormat):
        return fmt.calibrated(stats.key_mean[layer], stats.query_moment[layer], stats.key_spread[layer])
    raise TypeError(f"{fmt.name}: calibrated per layer, but kv_calibration has no statistics for {type(fmt).__name__}")


def calibrate_formats(formats: list[LayerFormats], stats: KVStats) -> list[LayerFormats]:
    """Each layer's per-head fp8 formats given that layer's maxima, its KIVI keys with wide
    channels given its key importance, and its fitted keys given its key mean, query moment
    and key spread; other formats unchanged."""
    return [(_calibrated(k, stats, layer, 0), _calibrated(v, stats, layer, 1))
            for layer, (k, v) in enumerate(formats)]


def needs_calibration(formats: list[LayerFormats] | None) -> bool:
    return formats is not None and any(f.calibrated_per_layer for pair in formats for f in pair)
