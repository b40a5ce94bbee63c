"""Shape and numerics of a Llama-family decoder (the families: model/architectures.py)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from kvserve.model.architectures import (GEMMA2, GEMMA3, GEMMAS, LLAMA, MISTRAL, QWEN2, QWEN3, Family, hf_family, layer_windows,
                                         refuse_unimplemented)
from kvserve.model.rope import LinearRopeScaling, RopeScaling, layered_rope_from_hf, rope_from_hf

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 2048
    tie_word_embeddings: bool = True
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    initializer_range: float = 0.02  # std of a random-weight model's matrices (HF's name and default)
    rope_scaling: RopeScaling | None = None  # of the full-attention layers where rope_local_theta is set
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each q and k head, before RoPE
    # Sliding windows: the layers in `sliding_layers` see only the last `sliding_window` positions
    # (Mistral, Qwen's windowed layers, Gemma 3's local layers); `layer_windows` spells it per layer.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3); None: rope_theta
    # Gemma 3's deltas from Llama.
    hidden_act: str = "silu"              # the gated MLP's activation: silu or gelu_pytorch_tanh (GeGLU)
    norm_offset: bool = False             # every RMSNorm scales by 1 + weight, in fp32
    sandwich_norms: bool = False          # attention and MLP outputs normalised before the residual add
    scale_embeddings: bool = False        # embeddings times sqrt(hidden_size), rounded to the model dtype
    query_pre_attn_scalar: int | None = None  # attention scale query_pre_attn_scalar ** -0.5; None: head_dim
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    attn_logit_softcapping: float | None = None   # Gemma 2: each attention logit capped the same way

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if not self.initializer_range > 0:
            raise ValueError(f"ModelConfig.initializer_range must be positive, got {self.initializer_range}")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if (self.sliding_window is None) != (not self.sliding_layers) or (
                self.sliding_window is not None and self.sliding_window < 1):
            raise ValueError(f"ModelConfig.sliding_window ({self.sliding_window}) must be positive exactly when "
                             f"sliding_layers ({self.sliding_layers}) names layers")
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers) or \
                list(self.sliding_layers) != sorted(set(self.sliding_layers)):
            raise ValueError(f"ModelConfig.sliding_layers must be increasing layer indices below num_layers "
                             f"({self.num_layers}), got {self.sliding_layers}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"ModelConfig.hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window; None for a layer that sees its whole context."""
        return tuple(self.sliding_window if i in self.sliding_layers else None for i in range(self.num_layers))

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers, at 2 bytes per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    def to_hf_dict(self) -> dict:
        """A `config.json` of the Hugging Face class that computes this model: Gemma 3 for its
        deltas, Qwen3 for q/k norms, Qwen2 for a q/k/v bias, Mistral for a window on every layer,
        else Llama."""
        family = self._hf_family()
        rope = {} if self.rope_scaling is None else {"rope_scaling": self.rope_scaling.to_hf_dict()}
        out = {
            "architectures": [family.hf_architecture],
            "model_type": family.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "initializer_range": self.initializer_range,
            family.activation[0]: self.hidden_act,
            "sliding_window": self.sliding_window,
            **rope,
        }
        if family.window != "always":
            out["layer_types"] = ["full_attention" if w is None else "sliding_attention" for w in self.layer_windows]
        if family.window == "switched":
            out["use_sliding_window"] = self.sliding_window is not None
        if family in GEMMAS:
            # Gemma's text models build a sliding mask even with no sliding layer: they need a window.
            out.update(sliding_window=self.sliding_window or self.max_position,
                       query_pre_attn_scalar=self.query_pre_attn_scalar or self.head_dim,
                       final_logit_softcapping=self.final_logit_softcapping)
        if family is GEMMA3:
            out["rope_local_base_freq"] = self.rope_local_theta or self.rope_theta
        if family is GEMMA2:
            out["attn_logit_softcapping"] = self.attn_logit_softcapping
        return out

    def _hf_family(self) -> Family:
        gemma = (self.norm_offset, self.sandwich_norms, self.scale_embeddings, self.qk_norm,
                 self.hidden_act == "gelu_pytorch_tanh", not self.qkv_bias)
        if all(gemma) and self.attn_logit_softcapping is None:
            return GEMMA3
        if all(gemma[:3] + gemma[4:]) and not self.qk_norm and self.rope_local_theta is None:
            return GEMMA2
        if self.attn_logit_softcapping is not None:
            raise ValueError("ModelConfig: only Gemma 2's class caps attention logits, and it has Gemma's "
                             "norms, embeddings and GeGLU, no q/k norms and no local RoPE base")
        if any(gemma[:3]) or self.hidden_act != "silu" or self.rope_local_theta is not None \
                or self.query_pre_attn_scalar is not None or self.final_logit_softcapping is not None:
            raise ValueError("ModelConfig: only Gemma 3's class has offset or sandwich norms, scaled embeddings, "
                             "GeGLU, a local RoPE base, query_pre_attn_scalar or logit soft-capping, and it has "
                             "all of the first four, q/k norms and no q/k/v bias")
        if self.qk_norm and self.qkv_bias:
            raise ValueError("ModelConfig: no Hugging Face class has q/k norms and a q/k/v bias "
                             "without an o_proj bias")
        if self.qk_norm or self.qkv_bias:
            return QWEN3 if self.qk_norm else QWEN2
        if not self.sliding_layers:
            return LLAMA
        if len(self.sliding_layers) != self.num_layers:
            raise ValueError("ModelConfig: windows on some layers of a Llama need Qwen's or Gemma's class")
        return MISTRAL

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        """A config.json of a supported architecture; `UnsupportedModel` names what is not."""
        family = hf_family(d)
        refuse_unimplemented(d, family)
        gemma = family in GEMMAS
        if family is GEMMA3:
            rope_theta, rope_scaling, local_theta = layered_rope_from_hf(d)
        else:
            (rope_theta, rope_scaling), local_theta = rope_from_hf(d), None
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        max_position = d.get("max_position_embeddings", 2048)
        windows = layer_windows(d, family, max_position)
        sliding = tuple(i for i, w in enumerate(windows) if w is not None)
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rope_theta=rope_theta,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            max_position=max_position,
            tie_word_embeddings=d.get("tie_word_embeddings", gemma),  # Gemma3TextConfig's default: tied
            qkv_bias=family.qkv_bias,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            initializer_range=d.get("initializer_range", 0.02),
            rope_scaling=rope_scaling,
            qk_norm=family.qk_norm,
            sliding_window=windows[sliding[0]] if sliding else None,
            sliding_layers=sliding,
            rope_local_theta=local_theta,
            hidden_act=family.activation[1],
            norm_offset=gemma,
            sandwich_norms=gemma,
            scale_embeddings=gemma,
            query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256) if gemma else None,
            final_logit_softcapping=d.get("final_logit_softcapping") if gemma else None,
            attn_logit_softcapping=d.get("attn_logit_softcapping") if family is GEMMA2 else None,
        )

    @classmethod
    def from_json(cls, path: Path) -> "ModelConfig":
        return cls.from_hf_dict(json.loads(Path(path).read_text()))

    def as_dict(self) -> dict:
        return asdict(self)


def _gemma3(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int,
            num_kv_heads: int, head_dim: int, sliding_window: int, max_position: int,
            query_pre_attn_scalar: int = 256, rope_scaling: RopeScaling | None = None) -> ModelConfig:
    """A Gemma 3 text decoder: what every size shares (Gemma3TextConfig's values, which the sizes'
    config.json files keep or leave to the defaults) around the numbers that differ. Every sixth
    layer is global (layer i when (i + 1) % 6 == 0, `layer_types` in the files), the rest slide."""
    return ModelConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                       num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position=max_position,
                       tie_word_embeddings=True, rope_scaling=rope_scaling,
                       qk_norm=True, sliding_window=sliding_window,
                       sliding_layers=tuple(i for i in range(num_layers) if (i + 1) % 6),
                       rope_local_theta=10_000.0, hidden_act="gelu_pytorch_tanh", norm_offset=True,
                       sandwich_norms=True, scale_embeddings=True, query_pre_attn_scalar=query_pre_attn_scalar)


# Shapes of models we cannot download; benchmarks build them with random weights and
# fewer layers, and `kvserve memory` prices them. Values from the models' published config.json files.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, max_position=512),
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                                rope_theta=100000.0, max_position=8192),
    "llama-2-7b": ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                              num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
                              max_position=4096, tie_word_embeddings=False),
    "llama-3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                              num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                              rope_theta=500000.0, max_position=8192, tie_word_embeddings=False),
    # GPT-3 has no config.json; shapes from Brown et al. 2020, table 2.1 (d_head 128, MHA).
    "gpt3-175b": ModelConfig(vocab_size=50257, hidden_size=12288, intermediate_size=49152,
                             num_layers=96, num_heads=96, num_kv_heads=96, head_dim=128,
                             max_position=2048, tie_word_embeddings=False),
    "llama-2-70b": ModelConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                               num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                               max_position=4096, tie_word_embeddings=False),
    # v0.2's config: rope_theta 1e6 and a 32k context with no sliding window.
    "mistral-7b": ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                              num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                              rope_theta=1000000.0, max_position=32768, tie_word_embeddings=False),
    # v0.1 (huggingface.co/mistralai/Mistral-7B-v0.1, config.json): v0.2's shape but rope_theta 1e4 and a
    # 4096-token sliding window on every layer (MistralForCausalLM ignores layer_types).
    "mistral-7b-v0.1": ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                   num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                                   max_position=32768, tie_word_embeddings=False, sliding_window=4096,
                                   sliding_layers=tuple(range(32))),
    # Gemma 3: huggingface.co/google/gemma-3-{270m,1b,4b,27b}-it, config.json. The 4B and 27B files are
    # Gemma3ForConditionalGeneration; their text_config leaves vocab (262208) and context (131072), and
    # the 4B's also heads (8), KV heads (4) and head_dim (256), to Gemma3TextConfig's defaults. 4B and 27B
    # scale the global layers' RoPE linearly by 8.
    "gemma-3-270m": _gemma3(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18,
                            num_heads=4, num_kv_heads=1, head_dim=256, sliding_window=512, max_position=32768),
    "gemma-3-1b": _gemma3(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_layers=26,
                          num_heads=4, num_kv_heads=1, head_dim=256, sliding_window=512, max_position=32768),
    "gemma-3-4b": _gemma3(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_layers=34,
                          num_heads=8, num_kv_heads=4, head_dim=256, sliding_window=1024, max_position=131072,
                          rope_scaling=LinearRopeScaling(8.0)),
    # head_dim 128 (not 5376 / 32 = 168) and query_pre_attn_scalar 168 are both in its text_config.
    "gemma-3-27b": _gemma3(vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_layers=62,
                           num_heads=32, num_kv_heads=16, head_dim=128, sliding_window=1024, max_position=131072,
                           query_pre_attn_scalar=168, rope_scaling=LinearRopeScaling(8.0)),
    # Multi-query attention: 71 query heads share one K/V head; head_dim = 4544 / 71.
    "falcon-7b": ModelConfig(vocab_size=65024, hidden_size=4544, intermediate_size=18176,
                             num_layers=32, num_heads=71, num_kv_heads=1, head_dim=64,
                             max_position=2048, tie_word_embeddings=False),
}
