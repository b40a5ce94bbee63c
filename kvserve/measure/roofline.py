"""How far a run is from the machine's limits, measured on the spot.

Two ceilings: reading memory (a decode step must read every weight once, plus the KV it
attends to) and matmul throughput (every token costs 2 FLOPs per weight it passes, plus
attention). Both are measured here, now, on this machine, with the dtype of the run, because a
shared machine's numbers move from hour to hour.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.huge_pages import huge_page_zeros
from kvserve.model.config import ModelConfig
from kvserve.model.cpu_linear import onednn_packs


@dataclass(frozen=True)
class Machine:
    read_gb_s: float       # streaming read of a buffer far larger than the caches
    matmul_gflop_s: float  # a large GEMM in the run's dtype (fp32 where the CPU has no native one), all threads


def _best(fn: object, reps: int) -> float:
    fn()  # type: ignore[operator]
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best


def measure_machine(dtype: torch.dtype, device: torch.device = torch.device("cpu")) -> Machine:
    # fp32: its sum streams at memory speed, where a bf16 sum is bound by the conversions. 1 GiB
    # is well past the caches (this machine's L3 alone is 260 MiB). In huge pages, as the engine's
    # weights and pages are (huge_pages.py): in 4 KiB pages a read of SmolLM2's weights measured 28
    # GB/s on AMD Zen 4, below the 31-33 its 8-row linears then streamed them at. Zeros: written
    # once, so resident, and a sum reads them as it reads any value.
    [big] = huge_page_zeros([((2**30 // 4,), torch.float32)], device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def read() -> None:
        big.sum()
        sync()

    read_s = _best(read, 5)
    # A CPU without native bf16 / fp16 matmuls (AVX2 only) is fastest widening them to fp32, as
    # kvserve's linears do there: its limit for such a run is the fp32 peak, not oneDNN's emulation.
    if device.type == "cpu" and dtype != torch.float32 and not onednn_packs(dtype):
        dtype = torch.float32
    x = torch.randn(1024, 2048, dtype=dtype, device=device)
    w = torch.randn(4096, 2048, dtype=dtype, device=device)

    def gemm() -> None:
        F.linear(x, w)
        sync()

    gemm_s = _best(gemm, 5)
    return Machine(big.nbytes / read_s / 1e9, 2 * x.shape[0] * w.shape[0] * w.shape[1] / gemm_s / 1e9)


def linear_params(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters of the decoder layers' matmuls, parameters of the LM head)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * per_layer, cfg.hidden_size * cfg.vocab_size


def workload_flops(cfg: ModelConfig, requests: list[tuple[int, int]]) -> float:
    """Useful FLOPs of (prompt_len, output_len) requests: every token through the layers, the
    LM head once per generated token, attention 4 * heads * head_dim per (query, key) pair."""
    layers, head = linear_params(cfg)
    attn = 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers
    total = 0.0
    for prompt, output in requests:
        n = prompt + output
        total += 2 * layers * n + 2 * head * output + attn * n * (n + 1) / 2
    return total


def decode_step_bytes(cfg: ModelConfig, dtype: torch.dtype, context: int, kv_bytes_per_token: float) -> float:
    """Bytes one decode step of one sequence must read: every weight once, and its context's K/V."""
    layers, head = linear_params(cfg)
    return (layers + head) * dtype.itemsize + context * kv_bytes_per_token


def pct_of_compute(flops: float, wall_s: float, machine: Machine) -> float:
    return 100 * flops / wall_s / (machine.matmul_gflop_s * 1e9)


def pct_of_bandwidth(bytes_per_step: float, step_s: float, machine: Machine) -> float:
    return 100 * bytes_per_step / step_s / (machine.read_gb_s * 1e9)
