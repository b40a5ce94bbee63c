"""The parallel and runtime parts of the configuration: how many ranks, and which kernels run the
model and its attention."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.attention.selector import BACKEND_NAMES
from kvserve.config.options import Options, opt
from kvserve.model.cpu_linear import SMALL_BATCH


@dataclass(frozen=True)
class ParallelOptions(Options):
    tensor_parallel_size: int = opt(1, "ranks to split the model over (attention heads and KV heads, MLP "
                                       "columns), each a process kvserve spawns, over torch.distributed (gloo, "
                                       "on the CPU); each rank's pool holds only its KV heads")

    def _check(self) -> None:
        self._positive("tensor_parallel_size")


@dataclass(frozen=True)
class RuntimeOptions(Options):
    attention_backend: str = opt(
        "auto", "auto: the fastest backend that serves the configuration (cpu: a C++ kernel reading pages "
                "in place; triton: Triton kernels, on CUDA); torch: the gather + SDPA reference",
        choices=BACKEND_NAMES)
    cpu_kernels: bool = opt(True, "fused C++ ops and the bf16 small-batch linear on CPU (built once, cached); "
                                  "off: eager torch")
    cpu_fused_step: bool = opt(True, f"run CPU steps of up to {SMALL_BATCH} tokens through the whole decoder "
                                     "stack in one C++ call, bit for bit the layered model (bf16 with the "
                                     "small-batch linear: AVX512-BF16 or AVX2; cpu backend; uncompressed pages "
                                     "or int8 / fp8 / int4 codes with no residual; no KV rotation; one rank); "
                                     "off: layer by layer from Python")
    cuda_graphs: bool = opt(True, "replay decode steps from CUDA graphs, one per batch-size bucket up to "
                                  "max_num_seqs, captured at start-up (CUDA, triton backend, uncompressed "
                                  "pages); off: every step launches its kernels eagerly")

    def _check(self) -> None:
        self._one_of("attention_backend", BACKEND_NAMES)
