"""The engine gives the same results with every attention backend and with the fused CPU ops
on or off: the `torch` backend with eager ops is the reference."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention.selector import BACKENDS
from kvserve.eval.quality import forced_logprobs
from kvserve.model.config import ModelConfig
from tests.backend_cases import NO_TRITON, backend_device, heavy, heavy_case
from tests.torch_threads import torch_threads

WINDOWS = [[(7 * i + 3 * j + j * j) % 128 for j in range(70)] for i in range(3)]
FAST = [dict(attention_backend=name, cpu_kernels=True, device=backend_device(name)) for name in BACKENDS
        if name != "torch"]
FAST_PARAMS = [heavy_case(c, backend=c["attention_backend"], id=c["attention_backend"]) for c in FAST]
REFERENCE = dict(attention_backend="torch", cpu_kernels=False)
# Backends whose kernels reach offloaded host blocks (a GPU kernel cannot: triton declines them).
OFFLOADING = [c for c in FAST if c["attention_backend"] != "triton"]


def reference_for(fast: dict[str, Any]) -> dict[str, Any]:
    """The reference on `fast`'s device: a GPU's fp32 matmuls round otherwise than the CPU's."""
    return dict(REFERENCE, device=fast["device"])


def ids(configs: list[dict[str, Any]]) -> list[str]:
    return [c["attention_backend"] for c in configs]


PAGES = {"dense": {}, "int8": dict(kv_cache_dtype="int8"),
         "fp8-window": dict(kv_cache_dtype="fp8_e4m3", kv_residual=20),
         "int4-window": dict(kv_cache_dtype="int4", kv_group_size=16, kv_residual=20),
         "kivi4": dict(kv_cache_dtype="kivi4", kv_group_size=16, kv_residual=20),
         "kivi2-wide-symmetric": dict(kv_cache_dtype="kivi2", kv_group_size=16, kv_residual=20, kv_exact_sink=True,
                                      kv_key_wide_channels=8, kv_symmetric_values=True, kv_rotation="hadamard",
                                      kv_rotate_keys=False),
         "int4-groups-per-role": dict(kv_cache_dtype="int4", kv_group_size_k=8, kv_group_size_v=16),
         "block1": dict(block_size=1), "block128": dict(block_size=128)}
# The Triton interpreter is slow: in CI it runs the page kinds (dense, absmax, grouped, channel).
TRITON_LIGHT = ("dense", "int8", "kivi4")


@pytest.mark.parametrize("fast,pages", [
    pytest.param(fast, pages, id=f"{b}-{name}", marks=[NO_TRITON] if b == "triton" else [])
    if b != "triton" or name in TRITON_LIGHT
    else heavy_case(fast, pages, backend=b, id=f"{b}-{name}")
    for fast in FAST for b in [fast["attention_backend"]] for name, pages in PAGES.items()])
def test_forced_decoding_matches_the_reference(tiny_llm: Callable[..., LLM], fast: dict[str, Any],
                                               pages: dict[str, Any]) -> None:
    """Prefill, then 40 decode steps of three sequences, logits compared at every step. Over
    compressed pages the two paths' fp32 rounding (summation order) can put a later token's K/V on
    the other side of a code boundary, which moves logprobs by ~2e-3 in this model; misread pages
    move them by tenths. The attention itself is equal over the same decoded values
    (tests/attention/test_backends.py)."""
    want = forced_logprobs(tiny_llm(max_num_seqs=3, **pages, **reference_for(fast)), WINDOWS, prefill_len=30)
    got = forced_logprobs(tiny_llm(max_num_seqs=3, **pages, **fast), WINDOWS, prefill_len=30)
    tolerance = 1e-4 if "kv_cache_dtype" not in pages else 1e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=1e-4)


@pytest.mark.parametrize("fast", FAST_PARAMS)
def test_sharing_and_preemption_match_the_reference(tiny_llm: Callable[..., LLM], fast: dict[str, Any]) -> None:
    """n > 1 samples, beam search, prefix hits and preemption in a pool too small for the batch."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8] * 5, [9, 10, 11], [1, 2, 3, 4, 5, 6, 7, 8] * 5 + [12, 13]]
    params = [SamplingParams(max_tokens=30, temperature=0.9, n=2, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=12, beam_width=2, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)]

    def run(**config: Any) -> tuple[list[list[int]], int]:
        llm = tiny_llm(max_num_seqs=4, kv_cache_memory=str(9 * 16 * 2 * 2 * 2 * 16 * 4), **config)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.token_ids for o in outs], llm.engine.scheduler.num_preemptions

    want, got = run(**reference_for(fast)), run(**fast)
    assert want[1] > 0  # the small pool really preempted
    assert got == want


@pytest.mark.parametrize("fast", OFFLOADING, ids=ids(OFFLOADING))
def test_offload_matches_the_reference(tiny_llm: Callable[..., LLM], fast: dict[str, Any]) -> None:
    """A sequence longer than the device pool: its cold blocks are read from host memory."""
    long = SamplingParams(max_tokens=100, temperature=0.8, seed=1, ignore_eos=True)

    def run(**config: Any) -> list[int]:
        offload = tiny_llm(max_num_seqs=1, kv_cache_memory=str(4 * 16 * 2 * 2 * 2 * 16 * 4),
                           offload_memory="1MiB", **config)
        return offload.generate([[5, 6, 7]], long, use_tqdm=False)[0].token_ids

    assert run(**fast) == run(**REFERENCE)


@NO_TRITON
def test_triton_declines_offloaded_pools(tiny_llm: Callable[..., LLM]) -> None:
    with pytest.raises(ValueError, match="attention_backend.*host blocks"):
        tiny_llm(max_num_seqs=1, kv_cache_memory="64KiB", offload_memory="1MiB", attention_backend="triton",
                 device=backend_device("triton"))


@pytest.mark.parametrize("pages", ["dense", "int8"])
def test_bf16_steps_give_the_same_logprobs_on_any_thread_count(pages: str) -> None:
    """Parallel test workers run one thread each: here the kernels' splits of a step's work
    across threads (linears' columns, attention's sequences and heads) meet a model wide enough
    to split, through the fused step and the layered one."""
    wide = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=8,
                       num_kv_heads=2, head_dim=32, max_position=512)
    runs = []
    for threads, fused in ((1, True), (2, True), (2, False)):
        with torch_threads(threads):
            llm = LLM(model=wide, dtype="bfloat16", device="cpu", kv_cache_memory="4MiB", max_model_len=256,
                      max_num_seqs=3, cpu_fused_step=fused, **PAGES[pages])
            runs.append(forced_logprobs(llm, [[t * 5 % 512 for t in w] for w in WINDOWS], prefill_len=30))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


@pytest.mark.model
def test_real_model_greedy_tokens_equal_across_backends(smol: LLM) -> None:
    """The bundled model in fp32: greedy continuations equal token for token."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a quiet village,"]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    assert smol.engine.attention_backend.name != "torch"  # the fixture takes the fast path
    fast = [o.token_ids for o in smol.generate(prompts, params, use_tqdm=False)]
    reference = LLM(dtype="float32", device="cpu", kv_cache_memory="64MiB", max_model_len=512, **REFERENCE)
    assert [o.token_ids for o in reference.generate(prompts, params, use_tqdm=False)] == fast


@pytest.mark.model
@NO_TRITON
@heavy
def test_real_model_greedy_tokens_with_triton(smol: LLM) -> None:
    """The Triton kernels on the bundled model (interpreted on a CPU: a short run)."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    triton_llm = LLM(dtype="float32", device=backend_device("triton"), kv_cache_memory="16MiB", max_model_len=128,
                     attention_backend="triton")
    got = [o.token_ids for o in triton_llm.generate(prompts, params, use_tqdm=False)]
    assert got == [o.token_ids for o in smol.generate(prompts, params, use_tqdm=False)]
