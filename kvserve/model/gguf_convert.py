"""GGUF files (llama.cpp's layout) -> Hugging Face style directories, cached.

Every tensor is dequantized to fp32 with the `gguf` package's own reference code (F32, F16, BF16,
Q4_0/1, Q5_0/1, Q8_0 and the K-quants Q2_K..Q6_K among others), then renamed and un-transformed per
architecture as llama.cpp's convert_hf_to_gguf.py wrote it: the Llama family here, Gemma 3 in
`gguf_gemma3`. The directory holds config.json, model.safetensors and the tokenizer transformers
builds from the GGUF's own metadata (vocabulary, special tokens, chat template).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from kvserve.model.architectures import LLAMA, UnsupportedModel, gguf_family
from kvserve.model.config import ModelConfig
from kvserve.model.gguf_gemma3 import GEMMA3_ARCH, gemma3_config, gemma3_name
from kvserve.paths import cache_root

if TYPE_CHECKING:
    from gguf import GGUFReader

# A field's value as GGUFReader.contents() gives it: a number, a string, a bool or a list of them.
FieldValue = int | float | str | bool | list
# A GGUF tensor's name and fp32 value -> its Hugging Face name and value.
Rename = Callable[[str, torch.Tensor], tuple[str, torch.Tensor]]


def gguf_field(reader: GGUFReader, key: str, default: FieldValue | None = None) -> FieldValue | None:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def cached_conversion(path: Path, prefix: str = "") -> Path:
    """Where a conversion of the file `path` lives in the cache: keyed by the file's place, size and
    time, so a changed file converts again."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / f"{prefix}{path.stem}-{key}"


def publish(out: Path, write: Callable[[Path], None]) -> Path:
    """Has `write` fill a temporary sibling of `out`, then renames it into place: no reader sees
    half a directory, and of two processes converting at once the first one's stays."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        write(tmp)
        tmp.rename(out)
    except OSError:
        if not (out / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def convert_gguf(path: Path) -> Path:
    """Dequantize a GGUF of a supported family (`architectures.GGUF_FAMILIES`, or gemma3) into a
    cached HF directory; returns that directory."""
    out = cached_conversion(path)
    if (out / "config.json").exists():
        return out
    import gguf

    reader = gguf.GGUFReader(path)
    arch = gguf_field(reader, "general.architecture")
    try:
        if arch == GEMMA3_ARCH:
            config, rename = gemma3_config(reader), gemma3_name
        else:
            config, rename = _llama_family(reader, arch)
        state: dict[str, torch.Tensor] = {}
        for name, tensor in _dequantized(reader, path):
            hf_name, tensor = rename(name, tensor)
            state[hf_name] = tensor
    except ValueError as err:  # ours (an unsupported option, missing metadata): name the file
        kind = UnsupportedModel if isinstance(err, UnsupportedModel) else ValueError
        raise kind(f"model: {path}: {err}") from None

    def write(tmp: Path) -> None:
        save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        from transformers import AutoTokenizer
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)

    return publish(out, write)


def _dequantized(reader: GGUFReader, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor in fp32 (numpy's C order: [rows, columns] as torch's Linear stores them)."""
    import gguf
    from tqdm import tqdm

    for t in tqdm(reader.tensors, desc=f"dequantizing {path.name}", unit="tensor"):
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise UnsupportedModel(f"tensor {t.name}: gguf cannot dequantize {t.tensor_type.name}") from None
        yield t.name, torch.from_numpy(values.copy()).float()


# The names convert_hf_to_gguf writes for Llama, Qwen2 and Qwen3 (gguf-py's MODEL_TENSORS).
_LLAMA_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LLAMA_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

def _unpermute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp interleaves each head's rotary pairs; undo it for the rotate-half convention."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _refuse_llama_options(reader: GGUFReader, arch: str) -> None:
    """GGUF metadata the decoder does not compute, named by its key."""
    head_dim = gguf_field(reader, f"{arch}.attention.key_length")
    rotary = gguf_field(reader, f"{arch}.rope.dimension_count")
    if head_dim is not None and rotary is not None and rotary != head_dim:
        raise UnsupportedModel(f"{arch}.rope.dimension_count: {rotary} of {head_dim} channels: RoPE over part of "
                               f"a head is not implemented")
    scaling = gguf_field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedModel(f"{arch}.rope.scaling.type: {scaling!r} is not implemented")
    window = gguf_field(reader, f"{arch}.attention.sliding_window")
    if window is not None and window < gguf_field(reader, f"{arch}.context_length", 2048):
        raise UnsupportedModel(f"{arch}.attention.sliding_window: sliding-window attention (window {window}) "
                               f"is not built yet")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):  # llama.cpp's form of Llama 3.x scaling
        raise UnsupportedModel("rope_freqs.weight: RoPE frequency factors (Llama 3.x scaling as llama.cpp "
                               "stores it) are not read yet; load the Hugging Face directory instead")


def _llama_family(reader: GGUFReader, arch: FieldValue | None) -> tuple[dict, Rename]:
    """config.json and the tensor renaming of a Llama, Qwen2 or Qwen3 GGUF."""
    family = gguf_family(arch)
    _refuse_llama_options(reader, arch)
    heads = gguf_field(reader, f"{arch}.attention.head_count")
    kv_heads = gguf_field(reader, f"{arch}.attention.head_count_kv", heads)
    hidden = gguf_field(reader, f"{arch}.embedding_length")
    names = {t.name for t in reader.tensors}
    cfg = ModelConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden,
        intermediate_size=gguf_field(reader, f"{arch}.feed_forward_length"),
        num_layers=gguf_field(reader, f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=gguf_field(reader, f"{arch}.attention.key_length",
                            gguf_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        rope_theta=float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=gguf_field(reader, f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm=family.qk_norm,
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=gguf_field(reader, "tokenizer.ggml.eos_token_id"),
    )

    def rename(name: str, w: torch.Tensor) -> tuple[str, torch.Tensor]:
        if name in _LLAMA_NAMES:
            return _LLAMA_NAMES[name], w
        _, layer, rest = name.split(".", 2) if name.startswith("blk.") else (None, None, None)
        if rest not in _LLAMA_LAYER_NAMES:
            raise UnsupportedModel(f"tensor {name} is not read by kvserve's {arch} decoder")
        # llama.cpp permutes q/k rows for its interleaved RoPE only in the Llama converter.
        if family is LLAMA and rest.startswith(("attn_q.", "attn_k.")):
            w = _unpermute_rope(w, heads if rest.startswith("attn_q.") else kv_heads)
        return f"model.layers.{layer}.{_LLAMA_LAYER_NAMES[rest]}", w

    return cfg.to_hf_dict(), rename
