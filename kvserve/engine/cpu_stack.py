"""Small CPU steps run the whole decoder stack in one C++ call: the CPU's counterpart of the
CUDA graphs in engine/cuda_graphs.py.

The layered model calls about nine ops per layer from Python, and on a one-stream decode step
their dispatch cost a fifth of the step beside the weights' read. `DecoderStack`
(kernels/csrc/decoder_stack.cpp) holds the layers' weights and the pool's pages and runs the
same kernels in the same order from C++, so a step gives the layered model's logits bit for bit.

It serves what those kernels cover: bf16 weights through the small-batch linear (AVX512-BF16 or AVX2),
the cpu attention backend over uncompressed pages or over codes its kernel encodes token by
token (int8, fp8, int4 with zero-points; no full-precision residual, so no step stages tokens
or seals blocks from Python), no KV rotation, one rank, every layer's linears in the kernel (input
sizes a multiple of 32); and steps of up to `SMALL_BATCH` tokens that keep no attention scores
(larger ones run layered: through oneDNN's linears on AVX-512; on AVX2 the same kernel, where
serving them here measured no faster).
"""
from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from kvserve.attention import AttentionBackend, StepMetadata
from kvserve.attention.cpu_paged import CPUPagedBackend
from kvserve.attention.rotation import KVRotation
from kvserve.model.cpu_linear import K_STEP, SMALL_BATCH, PackedLinear, SmallBatchLinear
from kvserve.model.llama import LlamaForCausalLM


class CPUDecodeStack:
    def __init__(self, model: LlamaForCausalLM, backend: CPUPagedBackend, kernels: ModuleType) -> None:
        """`model` with its linears already replaced by `SmallBatchLinear` (model/cpu_linear.py)."""
        self.model, self.widen = model, kernels.widen
        inner, cfg, e = model.model, model.config, torch.empty(0)
        weights = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights += [layer.input_layernorm.weight, attn.qkv_proj.weight,
                        e if attn.qkv_proj.bias is None else attn.qkv_proj.bias, attn.o_proj.weight,
                        layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight]
        self.stack = kernels.DecoderStack(
            weights, inner.norm.weight, inner.rotary.cos, inner.rotary.sin, backend.layer_args, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, inner.norm.eps, inner.layers[0].self_attn.scale, backend.pool.block_size)

    @staticmethod
    def unsupported(model: LlamaForCausalLM, backend: AttentionBackend, linear_kind: str | None,
                    rotation: KVRotation | None) -> str | None:
        """Why the stack cannot run this configuration's steps; None when it can. RoPE scaling needs
        nothing here: the kernel reads the model's own cos/sin tables."""
        cfg = model.config
        if cfg.norm_offset or cfg.sandwich_norms or cfg.hidden_act != "silu":
            return ("Gemma's layer (offset and sandwich norms, GeGLU, scaled embeddings): the stack's kernel "
                    "runs Llama's")
        if cfg.qk_norm:
            return "q/k norms per head (Qwen3): the stack's kernel runs none"
        if cfg.sliding_layers:
            return f"sliding-window layers (window {cfg.sliding_window}): the stack's kernel masks none"
        if linear_kind != "small-batch":
            return "needs bf16 weights and the small-batch linear (AVX512-BF16 or AVX2)"
        if any(isinstance(m, (nn.Linear, PackedLinear)) for m in model.model.layers.modules()):
            return f"a layer's input size is not a multiple of {K_STEP} (the small-batch linear's step)"
        if any(isinstance(m, SmallBatchLinear) and m.padded for m in model.model.layers.modules()):
            return "a layer's output size is not a multiple of 16 (the AVX2 linear pads those)"
        if not isinstance(backend, CPUPagedBackend):
            return "needs the cpu attention backend"
        if not backend.dense and (backend.pool.staged or not all(backend.encodes)):
            return ("needs uncompressed pages, or int8 / fp8 / int4 codes the kernel encodes token by token "
                    "with no full-precision residual")
        if rotation is not None:
            return "KV rotation"
        return None

    @staticmethod
    def serves(step: StepMetadata) -> bool:
        return int(step.query_start[-1]) <= SMALL_BATCH

    @torch.inference_mode()
    def run(self, step: StepMetadata, input_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """fp32 logits [len(rows), vocab] after the step's tokens at `rows`, as the model gives."""
        hidden = self.stack.forward(self.model.model.embed_tokens(input_ids), step.positions, step.slot_mapping,
                                    step.query_start, step.context_lens, step.block_tables)
        return self.widen(self.model.lm_head(hidden[rows]))
