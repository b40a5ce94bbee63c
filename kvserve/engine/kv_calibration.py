"""Per-head fp8 scales (`kv_fp8_scales="head"`): the largest |K| and |V| each layer's KV heads
store, measured once at start-up by running the model over a calibration text.

The model runs as it will serve (same attention path, RoPE and rotation) into a small dense pool
of its own, and the maxima are read from those pages, so the scales cover exactly what the
compressed pages will be asked to hold. The text is the Python reference prose that ships with
CPython, read from its middle, so that evaluations on its opening windows do not calibrate on
the text they measure; a model without a tokenizer (random test models) reads seeded random ids.
"""
from __future__ import annotations

from typing import Any

import torch

from kvserve.attention import StepAttention, StepMetadata
from kvserve.attention.torch_sdpa import TorchSDPABackend
from kvserve.cache.kv_format import HeadScaleFormat, KVFormat
from kvserve.cache.kv_pool import KVPool
from kvserve.cache.quantized_pool import LayerFormats
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.ops import Ops
from kvserve.texts import load_text

_CHARS_PER_TOKEN = 8  # generous: a slice this many characters per token always holds enough tokens


def calibration_tokens(tokenizer: Any, vocab_size: int, num_tokens: int, seed: int) -> list[int]:
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab_size, (num_tokens,), generator=g).tolist()
    text = load_text("python-docs").text
    middle = len(text) // 2
    ids = tokenizer.encode(text[middle:middle + num_tokens * _CHARS_PER_TOKEN])
    return ids[:num_tokens]


@torch.inference_mode()
def measure_kv_amax(model: LlamaForCausalLM, ops: Ops, token_ids: list[int], rotation: torch.Tensor | None,
                    dtype: torch.dtype, device: torch.device, block_size: int = 16) -> torch.Tensor:
    """[layers, 2 (K, V), kv_heads]: max |x| over the tokens and channels each head stores."""
    cfg = model.config
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    pool = KVPool(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    step = StepMetadata.build([n], [n], [list(range(num_blocks))], block_size, device)
    attention = StepAttention.of(TorchSDPABackend(pool, cfg.num_heads), step, None,
                                 None if rotation is None else rotation.to(device))
    model(torch.tensor(token_ids, device=device), attention, torch.tensor([n - 1], device=device), ops)
    return torch.stack([torch.stack([pages.flatten(0, 1)[:n].abs().amax((0, 2)) for pages in layer]).float()
                        for layer in pool.layers])


def calibrate_formats(formats: list[LayerFormats], amax: torch.Tensor) -> list[LayerFormats]:
    """Each layer's per-head formats given that layer's maxima; other formats unchanged."""
    def one(fmt: KVFormat, layer_amax: torch.Tensor) -> KVFormat:
        return fmt.calibrated(layer_amax) if isinstance(fmt, HeadScaleFormat) else fmt
    return [(one(k, a[0]), one(v, a[1])) for (k, v), a in zip(formats, amax)]


def needs_calibration(formats: list[LayerFormats] | None) -> bool:
    return formats is not None and any(isinstance(f, HeadScaleFormat) for pair in formats for f in pair)
