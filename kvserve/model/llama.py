"""A Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3, Gemma 2 and 3) whose attention reads the
paged pool; each family's deltas are options of its `ModelConfig` (model/architectures.py)."""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from kvserve.attention.backend import StepAttention
from kvserve.model.config import ModelConfig
from kvserve.model.ops import Ops
from kvserve.model.rope import RopeScaling, inverse_frequencies


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: Ops, residual: torch.Tensor | None = None) -> torch.Tensor:
        # Statistics in fp32 like the reference implementation, so bf16 runs agree with it.
        return ops.rms_norm(x, self.weight, self.eps, residual)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scaled by 1 + weight (stored as the offset from 1, so 0 is the identity),
    the product in fp32 before the cast, as transformers' Gemma3RMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, ops: Ops, residual: torch.Tensor | None = None) -> torch.Tensor:
        return ops.offset_rms_norm(x, self.weight, self.eps, residual)


@functools.cache
def rounded(value: float, dtype: torch.dtype) -> float:
    """`value` as `dtype` holds it: transformers rounds Gemma's embedding scale to the model dtype
    before the product (a Python float multiplies in fp32 and would round once, at the end)."""
    return float(torch.tensor(value, dtype=torch.float32).to(dtype))


def make_norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    return OffsetRMSNorm(dim, cfg.rms_norm_eps) if cfg.norm_offset else RMSNorm(dim, cfg.rms_norm_eps)


class RotaryEmbedding(nn.Module):
    """Non-interleaved ("rotate half") RoPE, the Hugging Face convention: fp32 tables of cos and
    sin per position (a scaling already in their frequencies), applied by `Ops.rope_split` and read
    as they are by the fused CPU stack. With `rope_local_theta` (Gemma 3) the sliding layers read
    a second pair, `local_cos` / `local_sin`, of that base and no scaling."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cos, sin = self._tables(cfg, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        local = (None, None) if cfg.rope_local_theta is None else self._tables(cfg, cfg.rope_local_theta, None)
        self.register_buffer("local_cos", local[0], persistent=False)
        self.register_buffer("local_sin", local[1], persistent=False)

    @staticmethod
    def _tables(cfg: ModelConfig, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, torch.Tensor]:
        # Built on the CPU even under the loader's meta device: there these ops would run torch's
        # Python references, whose first use imports torch._dynamo (~2 s of every start-up).
        inv_freq = inverse_frequencies(cfg.head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(cfg.max_position, dtype=torch.float32, device=inv_freq.device), inv_freq)
        return freqs.cos(), freqs.sin()

    def tables(self, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of a layer; `local`: a sliding layer, which has its own where a local base is set."""
        if local and self.local_cos is not None:
            return self.local_cos, self.local_sin
        return self.cos, self.sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q, k and v share one matmul: fewer, larger kernels per layer.
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.window = cfg.layer_windows[layer]
        # Qwen3, Gemma 3: one RMSNorm over each head's channels (weights shared by the heads), q and k apart.
        self.q_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, attention: StepAttention, ops: Ops) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.q_norm is not None and self.k_norm is not None:
            self._norm_heads(qkv, self.q_norm, self.k_norm, ops)
        cos, sin = rotary.tables(local=self.window is not None)
        q, k, v = ops.rope_split(qkv, attention.positions, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        return self.o_proj(attention(self.layer, q, k, v, self.scale, self.window).flatten(1))

    def _norm_heads(self, qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, ops: Ops) -> None:
        """q and k heads of the fused projection normalised in place, so RoPE reads them as before."""
        heads = qkv.unflatten(1, (-1, self.head_dim))
        q, k = heads[:, :self.num_heads], heads[:, self.num_heads:self.num_heads + self.num_kv_heads]
        for norm, part in ((q_norm, q), (k_norm, k)):
            # The compiled norm reads contiguous rows; one KV head's rows are a strided view.
            part.copy_(norm(part.reshape(-1, self.head_dim).contiguous(), ops).view_as(part))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.geglu = cfg.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.down_proj(ops.gelu_tanh_mul(gate_up) if self.geglu else ops.silu_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)
        self.mlp = MLP(cfg)
        # Gemma: post_attention_layernorm normalises the attention output alone, and these two
        # the MLP's input and output.
        self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size) if cfg.sandwich_norms else None
        self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size) if cfg.sandwich_norms else None

    def forward(self, normed: torch.Tensor, residual: torch.Tensor, next_norm: RMSNorm,
                rotary: RotaryEmbedding, attention: StepAttention, ops: Ops) -> torch.Tensor:
        """`normed` is this layer's input, already normalised; adds attention and MLP into the
        residual stream in place and returns it normalised by `next_norm` (the next layer's
        input norm, or the final one), so each residual add is fused with the norm after it."""
        out = self.self_attn(normed, rotary, attention, ops)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            normed = self.post_attention_layernorm(out, ops, residual)
            return next_norm(self.mlp(normed, ops), ops, residual)
        normed = self.pre_feedforward_layernorm(self.post_attention_layernorm(out, ops), ops, residual)
        return next_norm(self.post_feedforward_layernorm(self.mlp(normed, ops), ops), ops, residual)


class LlamaModel(nn.Module):
    """Parameter names follow Hugging Face's, except the fused `qkv_proj` and `gate_up_proj`
    (see `loader.fuse_hf_state` and `loader.hf_state_dict`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        # An empty table: the weights come from a checkpoint or the loader's random init, and
        # nn.Embedding's own init on the meta device imports torch._dynamo, as RotaryEmbedding says.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg)
        self.embed_scale = math.sqrt(cfg.hidden_size) if cfg.scale_embeddings else None

    def forward(self, input_ids: torch.Tensor, attention: StepAttention, ops: Ops) -> torch.Tensor:
        residual = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # Gemma
            residual = residual * rounded(self.embed_scale, residual.dtype)
        normed = self.layers[0].input_layernorm(residual, ops)
        layers = list(self.layers)  # slicing a ModuleList would build a new one every step
        norms = [layer.input_layernorm for layer in layers[1:]] + [self.norm]
        for layer, next_norm in zip(layers, norms):
            normed = layer(normed, residual, next_norm, self.rotary, attention, ops)
        return normed


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, attention: StepAttention, logit_index: torch.Tensor,
                ops: Ops) -> torch.Tensor:
        """Returns fp32 logits only for the rows in `logit_index` (each sequence's last token)."""
        hidden = self.model(input_ids, attention, ops)
        logits = self.lm_head(hidden[logit_index]).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
