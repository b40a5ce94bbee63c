"""Linear layers for inference on CPU.

A plain bf16 `F.linear` on CPU reformats the weight on every call, and an fp32 one (MKL's sgemm)
sums a row's products in an order that depends on how many rows the call has. Three replacements:
- `InvariantLinear` (fp32, with the compiled kernels): every row summed in k order whatever its
  batch (kernels.linear_f32), so an fp32 request gives the same logits alone, in a batch, in
  chunks or after a prefix hit; memory-bound decode runs as fast as MKL, a prefill's matmuls at a
  fraction of its speed (BENCHMARKS.md), the price of fp32 being the reference dtype.
- `SmallBatchLinear` (bf16, CPUs with AVX512-BF16, or AVX2 and FMA): up to `SMALL_BATCH` rows
  (decode steps) go through our kernel (VDPBF16PS, AMX tiles, or fp32 FMAs on widened weights),
  which reads each weight once per call and is bound by memory bandwidth, 1.2-3x faster than
  oneDNN at these sizes; larger batches (prefill) through oneDNN, where its blocking wins and the
  on-the-fly reorder is amortised, in output-column chunks on the kernels' thread pool
  (`linear_rows`: on a busy machine torch's OpenMP team waits for a descheduled thread at every
  matmul); except on AVX2, where oneDNN has no bf16 matmul faster than our kernel and every batch
  goes through the kernel.
- `PackedLinear` otherwise: the weight prepacked once for oneDNN (about 1.5x over `F.linear`),
  where oneDNN can prepack the dtype on this CPU.
See BENCHMARKS.md for the measurements.
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable

import torch
from torch import nn

SMALL_BATCH = 32  # rows up to which our kernel beats oneDNN (measured per shape, BENCHMARKS.md)
# oneDNN builds and caches a primitive for every row count it sees; with chunked prefill nearly
# every step has a new one, and the cache grew the server's memory without bound (BENCHMARKS.md,
# issue 10 item 12). A matmul runs as a multiple of this many rows plus the remainder, so the
# row counts it sees are bounded: padding the rows instead cost ~6% of mixed throughput.
ROW_BUCKET = 64
GROUP = 16  # weight rows the AVX2 kernel interleaves (interleave_rows)
K_STEP = 32  # linear_bf16's kernels read k in steps of 32: in_features must be a multiple


def onednn_rows(x: torch.Tensor, matmul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`matmul(x)` as at most two calls: the first rows in a multiple of ROW_BUCKET, the rest."""
    bulk = x.shape[0] // ROW_BUCKET * ROW_BUCKET
    if bulk == 0 or bulk == x.shape[0]:
        return matmul(x)
    return torch.cat([matmul(x[:bulk]), matmul(x[bulk:])])


def interleave_rows(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / GROUP), K / 2, GROUP, 2]: each group of 16 rows in pairs of k, so a
    cache line holds the group's weights at k and k + 1 and a group is one stream for the AVX2
    kernel (linear_avx2.cpp). Zero rows pad N to a multiple of 16."""
    n, k = weight.shape
    padded = torch.cat([weight, weight.new_zeros(-n % GROUP, k)]) if n % GROUP else weight.contiguous()
    return padded.view(-1, GROUP, k // 2, 2).transpose(1, 2).contiguous()


def kernel_layout(weight: torch.Tensor, kernels: ModuleType) -> torch.Tensor:
    """The [N, K] weight as `kernels.linear_bf16` reads it: interleaved for the AVX2 kernel (whose
    output then has N rounded up to a multiple of GROUP), [N, K] for the others."""
    return interleave_rows(weight) if kernels.interleaves_bf16_weights() else weight.contiguous()


class SmallBatchLinear(nn.Module):
    def __init__(self, linear: nn.Linear, kernels: ModuleType) -> None:
        super().__init__()
        self.kernels = kernels
        self.out_features = linear.out_features
        self.register_buffer("weight", kernel_layout(linear.weight.detach(), kernels), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)

    @property
    def interleaved(self) -> bool:
        """Whether the weight is in the AVX2 kernel's interleaved layout (interleave_rows)."""
        return self.weight.dim() == 4

    @property
    def padded(self) -> bool:
        """Whether the kernel's output has zero columns past out_features (interleaved weights)."""
        return self.interleaved and self.out_features % GROUP != 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # On AVX2 (interleaved weights) the kernel takes every batch: oneDNN's bf16 matmul there is
        # emulated, and an fp32 one on weights widened per call was 1.3-3x slower at 33-128 rows and
        # no faster above (BENCHMARKS.md). A row's bits then never depend on its batch.
        if x.shape[0] > SMALL_BATCH and not self.interleaved:
            return self.kernels.linear_rows(x, self.weight, self.bias, ROW_BUCKET)
        out = self.kernels.linear_bf16(x.contiguous(), self.weight, self.bias)
        return out[:, :self.out_features].contiguous() if self.padded else out


class InterleavedEmbedding(nn.Module):
    """The token embedding of a model whose LM head shares its weight, read from that head's
    interleaved weight (one copy of the table)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.weight.dim() == 3:  # fp32, [G, K, 16] (interleave_f32)
            return self.weight[input_ids // GROUP, :, input_ids % GROUP]
        return self.weight.transpose(1, 2)[input_ids // GROUP, input_ids % GROUP].flatten(-2)


def interleave_f32(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 -> [ceil(N / GROUP), K, GROUP]: each group of 16 rows with its 16 weights at a k
    side by side (linear_f32.cpp); zero rows pad N to a multiple of 16."""
    n, k = weight.shape
    padded = torch.cat([weight, weight.new_zeros(-n % GROUP, k)]) if n % GROUP else weight
    return padded.reshape(-1, GROUP, k).transpose(1, 2).contiguous()


class InvariantLinear(nn.Module):
    def __init__(self, linear: nn.Linear, kernels: ModuleType) -> None:
        super().__init__()
        self.kernels = kernels
        self.out_features = linear.out_features
        self.register_buffer("weight", interleave_f32(linear.weight.detach()), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernels.linear_f32(x.reshape(-1, x.shape[-1]).contiguous(), self.weight, self.bias)
        if self.out_features % GROUP:
            out = out[:, :self.out_features].contiguous()
        return out.view(*x.shape[:-1], self.out_features)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.out_features = linear.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()),
                             persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_rows(x, lambda rows: torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias,
                                                                              "none", [], ""))


def cpu_linear_kind(device: torch.device, dtype: torch.dtype, kernels: ModuleType | None) -> str | None:
    """"small-batch", "batch-invariant", "packed", or None (keep nn.Linear) for this device, dtype
    and kernels."""
    if device.type == "cpu" and dtype == torch.float32 and kernels is not None:
        return "batch-invariant"
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return None
    if dtype == torch.bfloat16 and kernels is not None and kernels.has_bf16_gemm():
        return "small-batch"
    return "packed" if onednn_packs(dtype) else None


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacks `dtype` weights on this CPU: its bf16 / fp16 paths need AVX-512 or
    AVX-NE-CONVERT, and elsewhere the reorder raises (an AVX2-only CPU keeps nn.Linear)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.ops.mkldnn._is_mkldnn_fp16_supported()


def cpu_linear(linear: nn.Linear, kind: str, kernels: ModuleType | None) -> nn.Module:
    """`linear` as the `kind` of CPU linear; a layer the small-batch kernel cannot read (in_features
    not a multiple of K_STEP) as oneDNN's packed linear where it packs bf16, else unchanged."""
    if kind == "small-batch" and linear.in_features % K_STEP == 0:
        return SmallBatchLinear(linear, kernels)
    if kind == "batch-invariant":
        return InvariantLinear(linear, kernels)
    if kind == "packed" or onednn_packs(linear.weight.dtype):
        return PackedLinear(linear)
    return linear


def replace_linears(model: nn.Module, kind: str, kernels: ModuleType | None) -> None:
    """Swaps every nn.Linear in `model` for the `kind` of CPU linear (`cpu_linear`), in place. A
    shared weight (tied embeddings) stays one tensor: an embedding that shares a weight the kernel
    reads interleaved becomes an `InterleavedEmbedding` of it."""
    # Names, not modules: each old linear is freed as it is replaced, so the weights are never all
    # held twice.
    targets = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    replaced: dict[int, nn.Module] = {}
    for parent, name in targets:
        linear = getattr(parent, name)
        new = cpu_linear(linear, kind, kernels)
        replaced[id(linear.weight)] = new
        setattr(parent, name, new)
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            head = replaced.get(id(child.weight)) if isinstance(child, nn.Embedding) else None
            if isinstance(head, InvariantLinear) or (isinstance(head, SmallBatchLinear) and head.interleaved):
                setattr(parent, name, InterleavedEmbedding(head.weight))
