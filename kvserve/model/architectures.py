"""The model families kvserve runs, and the config options it refuses.

Every family is the one Llama decoder (model/llama.py) with its deltas, which `ModelConfig`'s
fields carry. A family is chosen by config.json's `architectures` (or, in files without it,
`model_type`) or by a GGUF's `general.architecture`. Any other architecture, and any option of a
supported one that the decoder does not compute, is refused with the field's name: run as plain
Llama it would load without a word and give other tokens than the model.
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
    qk_norm: bool         # RMSNorm over each q and k head before RoPE (Qwen3)
    # How its Hugging Face class reads `sliding_window`: not at all (Llama), on every layer
    # (Mistral), or under `use_sliding_window` (default off) from `max_window_layers` up (Qwen).
    window: Literal["ignored", "always", "switched"]


LLAMA = Family("LlamaForCausalLM", "llama", qkv_bias=False, qk_norm=False, window="ignored")
MISTRAL = Family("MistralForCausalLM", "mistral", qkv_bias=False, qk_norm=False, window="always")
QWEN2 = Family("Qwen2ForCausalLM", "qwen2", qkv_bias=True, qk_norm=False, window="switched")
QWEN3 = Family("Qwen3ForCausalLM", "qwen3", qkv_bias=False, qk_norm=True, window="switched")
FAMILIES = (LLAMA, MISTRAL, QWEN2, QWEN3)
# llama.cpp writes Mistral's dense models as `llama`; the names are its `general.architecture`.
GGUF_FAMILIES = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3}


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
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"hidden_act: {act!r} is not implemented (kvserve's MLP is SiLU-gated)")
    if d.get("mlp_bias"):
        raise UnsupportedModel("mlp_bias: true is not implemented (the MLP's linears have no bias)")
    if d.get("attention_bias") and not family.qkv_bias:
        raise UnsupportedModel(f"attention_bias: true is not implemented for {family.hf_architecture} "
                               f"(its o_proj bias); Qwen2's q/k/v bias is")
    _refuse_sliding_window(d, family)


def _refuse_sliding_window(d: dict, family: Family) -> None:
    window = d.get("sliding_window")
    switched_off = family.window == "switched" and not d.get("use_sliding_window", False)
    if family.window == "ignored" or window is None or switched_off:
        return
    # A window that covers every position the model serves masks nothing: full attention, exact.
    if window >= d.get("max_position_embeddings", 2048):
        return
    layer_types = d.get("layer_types")
    if layer_types is not None:
        if all(kind == "full_attention" for kind in layer_types):
            return
        field = "layer_types"
    # Qwen's layers below max_window_layers (transformers' default 28) attend in full: here, all.
    elif family.window == "switched" and d.get("max_window_layers", 28) >= d["num_hidden_layers"]:
        return
    else:
        field = "sliding_window"
    raise UnsupportedModel(f"{field}: sliding-window attention (sliding_window {window}) is not built yet; "
                           f"kvserve runs only models whose layers attend to the whole context")
