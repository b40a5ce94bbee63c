"""Gemma 3 text GGUFs as llama.cpp writes them -> Hugging Face `Gemma3ForCausalLM` names and config.

What llama.cpp's converter (convert_hf_to_gguf.py, Gemma3Model) does, undone here:
- every `*norm.weight` (the four per-layer norms, the q/k norms, the final norm) is stored as
  w + 1, because Gemma's RMSNorm computes x * (1 + w) and llama.cpp's computes x * w; the HF
  weight is the stored one minus 1 (transformers' GGUF loader, Gemma2TensorProcessor, does the same);
- q/k are NOT permuted (only the Llama converter interleaves rotary pairs);
- what the file does not store, llama.cpp's loader (llama-model.cpp, LLM_ARCH_GEMMA3) fixes in
  code, and so does this config: every sixth layer global, the rest sliding (none when the file
  has no sliding window); RoPE base 10000 on sliding layers; the attention scale 1/sqrt(head_dim),
  except the 62-layer 27B's 1/sqrt(hidden / heads).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvserve.model.architectures import UnsupportedModel

if TYPE_CHECKING:
    from gguf import GGUFReader

GEMMA3_ARCH = "gemma3"
SLIDING_PATTERN = 6          # llama.cpp: hparams.set_swa_pattern(6)
LOCAL_ROPE_BASE = 10000.0    # llama.cpp: rope_freq_base_train_swa
_LAYERS_27B = 62             # llama.cpp's LLM_TYPE_27B, whose attention scale differs

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# gguf-py's MODEL_TENSORS[GEMMA3], per layer.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def gemma3_name(name: str, w: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A GGUF tensor's HF name and value."""
    if name in _TOP_NAMES:
        hf = _TOP_NAMES[name]
    else:
        _, layer, rest = name.split(".", 2) if name.startswith("blk.") else ("", "", "")
        if rest not in _LAYER_NAMES:
            raise UnsupportedModel(f"tensor {name} is not part of a Gemma 3 text model")
        hf = f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
    if name.endswith("norm.weight"):
        w = w - 1  # stored as 1 + w (see the module's docstring)
    return hf, w


def gemma3_config(reader: GGUFReader) -> dict:
    """The config.json of `Gemma3ForCausalLM`, in the form of Google's own files (rope_theta,
    rope_local_base_freq, rope_scaling), which transformers 4.50+ and 5 both read."""
    def field(key: str, default: int | float | str | None = None) -> int | float | str:
        meta = reader.fields.get(f"{GEMMA3_ARCH}.{key}")
        if meta is not None:
            return meta.contents()
        if default is None:
            raise ValueError(f"{GEMMA3_ARCH}.{key}: missing from the GGUF metadata")
        return default

    heads, hidden, layers = field("attention.head_count"), field("embedding_length"), field("block_count")
    head_dim = field("attention.key_length")
    for key in ("attention.value_length", "rope.dimension_count"):
        if field(key, head_dim) != head_dim:
            raise UnsupportedModel(f"{GEMMA3_ARCH}.{key}: {field(key)} differs from attention.key_length "
                                   f"{head_dim}; Gemma 3 has one head_dim")
    window = reader.fields.get(f"{GEMMA3_ARCH}.attention.sliding_window")
    layer_types = ["sliding_attention" if window is not None and (i + 1) % SLIDING_PATTERN else "full_attention"
                   for i in range(layers)]
    names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("tokenizer.ggml.tokens: missing from the GGUF metadata")

    def token(key: str) -> int | None:
        meta = reader.fields.get(f"tokenizer.ggml.{key}")
        return None if meta is None else meta.contents()

    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": len(tokens.data),
        "hidden_size": hidden,
        "intermediate_size": field("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": field("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": field("context_length"),
        "rms_norm_eps": field("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": field("rope.freq_base", 1_000_000.0),
        "rope_local_base_freq": LOCAL_ROPE_BASE,
        "rope_scaling": _rope_scaling(reader),
        "sliding_window": None if window is None else window.contents(),
        "layer_types": layer_types,
        "query_pre_attn_scalar": hidden // heads if layers == _LAYERS_27B else head_dim,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": token("bos_token_id"),
        "eos_token_id": token("eos_token_id"),
        "pad_token_id": token("padding_token_id"),
    }


def _rope_scaling(reader: GGUFReader) -> dict | None:
    """Linear scaling of the global layers' positions (Gemma 3 4B and up); llama.cpp leaves the
    sliding layers unscaled (rope_freq_scale_train_swa = 1), as transformers does."""
    kind = reader.fields.get(f"{GEMMA3_ARCH}.rope.scaling.type")
    if kind is None or kind.contents() == "none":
        return None
    if kind.contents() != "linear":
        raise UnsupportedModel(f"{GEMMA3_ARCH}.rope.scaling.type: {kind.contents()!r} is not a Gemma 3 "
                               f"scaling (linear)")
    factor = reader.fields.get(f"{GEMMA3_ARCH}.rope.scaling.factor")
    if factor is None:
        raise ValueError(f"{GEMMA3_ARCH}.rope.scaling.factor: missing beside rope.scaling.type 'linear'")
    return {"rope_type": "linear", "factor": float(factor.contents())}
