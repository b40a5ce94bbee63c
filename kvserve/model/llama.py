"""A Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3) whose attention reads the paged
pool; each family's deltas are options of its `ModelConfig` (model/architectures.py)."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.attention.backend import StepAttention
from kvserve.model.config import ModelConfig
from kvserve.model.ops import Ops
from kvserve.model.rope import inverse_frequencies


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: Ops, residual: torch.Tensor | None = None) -> torch.Tensor:
        # Statistics in fp32 like the reference implementation, so bf16 runs agree with it.
        return ops.rms_norm(x, self.weight, self.eps, residual)


class RotaryEmbedding(nn.Module):
    """Non-interleaved ("rotate half") RoPE, the Hugging Face convention: fp32 tables of cos and
    sin per position (Llama 3's scaling already in their frequencies), applied by `Ops.rope_split`
    and read as they are by the fused CPU stack."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # Built on the CPU even under the loader's meta device: there these ops would run torch's
        # Python references, whose first use imports torch._dynamo (~2 s of every start-up).
        inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        freqs = torch.outer(torch.arange(cfg.max_position, dtype=torch.float32, device=inv_freq.device), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q, k and v share one matmul: fewer, larger kernels per layer.
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim ** -0.5
        # Qwen3: one RMSNorm over each head's channels (weights shared by the heads), q and k apart.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, attention: StepAttention, ops: Ops) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.q_norm is not None and self.k_norm is not None:
            self._norm_heads(qkv, self.q_norm, self.k_norm, ops)
        q, k, v = ops.rope_split(qkv, attention.positions, rotary.cos, rotary.sin,
                                 self.num_heads, self.num_kv_heads, self.head_dim)
        return self.o_proj(attention(self.layer, q, k, v, self.scale).flatten(1))

    def _norm_heads(self, qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, ops: Ops) -> None:
        """q and k heads of the fused projection normalised in place, so RoPE reads them as before."""
        heads = qkv.unflatten(1, (-1, self.head_dim))
        q, k = heads[:, :self.num_heads], heads[:, self.num_heads:self.num_heads + self.num_kv_heads]
        for norm, part in ((q_norm, q), (k_norm, k)):
            # reshape copies the strided heads into the contiguous rows the compiled norm needs
            part.copy_(norm(part.reshape(-1, self.head_dim), ops).view_as(part))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, normed: torch.Tensor, residual: torch.Tensor, next_norm: RMSNorm,
                rotary: RotaryEmbedding, attention: StepAttention, ops: Ops) -> torch.Tensor:
        """`normed` is this layer's input, already normalised; adds attention and MLP into the
        residual stream in place and returns it normalised by `next_norm` (the next layer's
        input norm, or the final one), so each residual add is fused with the norm after it."""
        attn = self.self_attn(normed, rotary, attention, ops)
        normed = self.post_attention_layernorm(attn, ops, residual)
        return next_norm(self.mlp(normed, ops), ops, residual)


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
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg)

    def forward(self, input_ids: torch.Tensor, attention: StepAttention, ops: Ops) -> torch.Tensor:
        residual = self.embed_tokens(input_ids)
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
        return self.lm_head(hidden[logit_index]).float()
