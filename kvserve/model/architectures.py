"""The model families kvserve runs, and the config options it refuses.

Every family is the one Llama decoder (model/llama.py) with its deltas, which `ModelConfig`'s
fields carry. A family is chosen by config.json's `architectures` (or, in files without it,
`model_type`) or by a GGUF's `general.architecture`. Any other architecture, and any option of a
supported one that the decoder does not compute, is refused with the field's name: run as plain
Llama it would load without a word and give other tokens than the model.

Sliding windows are read per layer as each family's Hugging Face class reads them (`layer_windows`):
a layer with window w lets the query at position p see keys p - w + 1 .. p.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


class UnsupportedModel(ValueError):
    """A model file names an architecture or option kvserve does not implement."""


@dataclass(frozen=True)
class Family:
    hf_architecture: str
    model_type: str
    qkv_bias: bool        # q/k/v projections always carry a bias (Qwen2), whatever `attention_bias` says
    qk_norm: bool         # RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    # How its Hugging Face class reads `sliding_window`: not at all (Llama), on every layer
    # (Mistral), under `use_sliding_window` (default off) on the `layer_types` marked sliding, by
    # default from `max_window_layers` up (Qwen), or on the `layer_types` marked sliding, by default
    # all but every `sliding_window_pattern`-th (Gemma 3).
    window: Literal["ignored", "always", "switched", "layer_types"]
    # The config key naming the MLP's activation, and the one value the family's MLP computes.
    activation: tuple[str, str] = ("hidden_act", "silu")
    # window "layer_types", in files without them: every `global_every`-th layer is global.
    global_every: int = 6


LLAMA = Family("LlamaForCausalLM", "llama", qkv_bias=False, qk_norm=False, window="ignored")
MISTRAL = Family("MistralForCausalLM", "mistral", qkv_bias=False, qk_norm=False, window="always")
QWEN2 = Family("Qwen2ForCausalLM", "qwen2", qkv_bias=True, qk_norm=False, window="switched")
QWEN3 = Family("Qwen3ForCausalLM", "qwen3", qkv_bias=False, qk_norm=True, window="switched")
# Gemma 3's further deltas (offset norms, four per layer, scaled embeddings, GeGLU, its own
# attention scale and RoPE per layer kind, final logit soft-capping) are read by
# `ModelConfig.from_hf_dict`. Its `attn_logit_softcapping` is read by nobody: transformers'
# Gemma3Attention keeps it but never passes it to the attention. Gemma 2's does: Gemma 2 is Gemma 3
# without q/k norms or a local RoPE base, with attention logits soft-capped, every other layer
# sliding.
GEMMA3 = Family("Gemma3ForCausalLM", "gemma3_text", qkv_bias=False, qk_norm=True, window="layer_types",
                activation=("hidden_activation", "gelu_pytorch_tanh"))
GEMMA2 = Family("Gemma2ForCausalLM", "gemma2", qkv_bias=False, qk_norm=False, window="layer_types",
                activation=("hidden_activation", "gelu_pytorch_tanh"), global_every=2)
GEMMAS = (GEMMA2, GEMMA3)
FAMILIES = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3)
# llama.cpp writes Mistral's dense models as `llama`; the names are its `general.architecture`.
GGUF_FAMILIES = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3}
LAYER_TYPES = ("full_attention", "sliding_attention")


def hf_family(d: dict) -> Family:
    """The family a config.json names; KeyError when it names none (not a model config)."""
    names = d.get("architectures")
    if names is None:
        if "model_type" not in d:
            raise KeyError("architectures")
        model_type = d["model_type"]
        match = next((f for f in FAMILIES if f.model_type == model_type), None)
        if match is None:
            raise UnsupportedModel(f"model_type: {model_type!r} is not supported (kvserve runs "
                                   f"{', '.join(f.model_type for f in FAMILIES)})")
        return match
    if not isinstance(names, list) or len(names) != 1:
        raise UnsupportedModel(f"architectures: expected one architecture, got {names!r}")
    match = next((f for f in FAMILIES if f.hf_architecture == names[0]), None)
    if match is None:
        raise UnsupportedModel(f"architectures: {names[0]!r} is not supported (kvserve runs "
                               f"{', '.join(f.hf_architecture for f in FAMILIES)})")
    return match


def gguf_family(arch: object) -> Family:
    if arch not in GGUF_FAMILIES:
        raise UnsupportedModel(f"general.architecture: {arch!r} is not supported (kvserve reads "
                               f"{', '.join(GGUF_FAMILIES)})")
    return GGUF_FAMILIES[arch]


def refuse_unimplemented(d: dict, family: Family) -> None:
    """Options of a config.json the decoder does not compute (RoPE types: `rope.rope_from_hf`)."""
    key, implemented = family.activation
    act = d.get(key, implemented)
    if act != implemented:
        raise UnsupportedModel(f"{key}: {act!r} is not implemented (kvserve's {family.hf_architecture} MLP is "
                               f"{implemented})")
    if d.get("mlp_bias"):
        raise UnsupportedModel("mlp_bias: true is not implemented (the MLP's linears have no bias)")
    if d.get("attention_bias") and not family.qkv_bias:
        raise UnsupportedModel(f"attention_bias: true is not implemented for {family.hf_architecture} "
                               f"(its o_proj bias); Qwen2's q/k/v bias is")
    if family in GEMMAS and d.get("use_bidirectional_attention"):
        raise UnsupportedModel("use_bidirectional_attention: true (EmbeddingGemma) is not implemented; "
                               "kvserve's attention is causal")


def layer_windows(d: dict, family: Family, max_position: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: it attends to the whole context), as the family's
    Hugging Face class reads config.json. A window covering every position the model serves masks
    nothing and is read as None, so such a model keeps every backend."""
    layers = d["num_hidden_layers"]
    window = d.get("sliding_window", 4096)  # the default of every windowed family's config class
    if family.window == "ignored" or window is None:
        return (None,) * layers
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise UnsupportedModel(f"sliding_window: expected a positive integer, got {window!r}")
    if family.window == "switched" and not d.get("use_sliding_window", False):
        return (None,) * layers
    types = d.get("layer_types")
    if family.window == "always":  # MistralForCausalLM windows every layer; it ignores layer_types
        sliding = [True] * layers
    elif types is not None:
        if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
            raise UnsupportedModel(f"layer_types: expected {layers} of {', '.join(LAYER_TYPES)}, got {types!r}")
        sliding = [t == "sliding_attention" for t in types]
    elif family.window == "switched":  # transformers' default: layers from max_window_layers up
        sliding = [i >= d.get("max_window_layers", 28) for i in range(layers)]
    else:  # Gemma files from before layer_types: every pattern-th layer is global
        pattern = d.get("sliding_window_pattern", family.global_every)
        sliding = [bool((i + 1) % pattern) for i in range(layers)]
    return tuple(window if s and window < max_position else None for s in sliding)
