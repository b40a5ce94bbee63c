"""KV memory management benchmarks: prefix caching, sharing between samples, swap vs recompute.

Each experiment runs kvserve twice on one workload, with the feature on and off, and reports
the ratio. Prompts are WikiText-2 token slices; outputs run to max_tokens (ignore_eos).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvserve.bench.metrics import BenchSummary
from kvserve.bench.throughput import run_kvserve
from kvserve.sampling_params import SamplingParams

MakeLLM = Callable[..., Any]


def _slices(ids: list[int], count: int, length: int, offset: int = 0) -> list[list[int]]:
    return [ids[offset + i * length: offset + (i + 1) * length] for i in range(count)]


def shared_system_prompt(make_llm: MakeLLM, ids: list[int], num_requests: int = 32,
                         system_len: int = 384, question_len: int = 32,
                         max_tokens: int = 32) -> list[BenchSummary]:
    """(a) Every request starts with the same long system prompt."""
    system = ids[:system_len]
    prompts = [system + q for q in _slices(ids, num_requests, question_len, offset=system_len)]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)] * num_requests
    return [run_kvserve(make_llm(enable_prefix_caching=on), prompts, params,
                        f"prefix-caching-{'on' if on else 'off'}") for on in (True, False)]


def parallel_samples(make_llm: MakeLLM, ids: list[int], num_prompts: int = 8, n: int = 4,
                     prompt_len: int = 256, max_tokens: int = 64) -> list[BenchSummary]:
    """(b) n samples per prompt sharing the prompt's blocks vs n separate seeded requests."""
    prompts = _slices(ids, num_prompts, prompt_len)
    base = dict(max_tokens=max_tokens, temperature=0.8, top_p=0.95, ignore_eos=True)
    shared = run_kvserve(make_llm(), prompts, [SamplingParams(n=n, seed=i * n, **base)
                                               for i in range(num_prompts)], f"n={n}-shared")
    separate = run_kvserve(make_llm(enable_prefix_caching=False), [p for p in prompts for _ in range(n)],
                           [SamplingParams(seed=i * n + j, **base) for i in range(num_prompts)
                            for j in range(n)], f"n={n}-separate")
    return [shared, separate]


def beam_search(make_llm: MakeLLM, ids: list[int], num_prompts: int = 4, width: int = 4,
                prompt_len: int = 256, max_tokens: int = 48) -> BenchSummary:
    """(b') Beam search: blocks in use vs what the beams' block tables would need unshared."""
    prompts = _slices(ids, num_prompts, prompt_len)
    params = [SamplingParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)] * num_prompts
    return run_kvserve(make_llm(), prompts, params, f"beam-width={width}")


def long_sequence_offload(make_llm: MakeLLM, ids: list[int], prompt_len: int = 32,
                          max_tokens: int = 480) -> list[BenchSummary]:
    """(d) One sequence 4x the device pool (cold blocks on the host) vs a pool that holds it."""
    prompt = ids[:prompt_len]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)]
    # bf16 SmolLM2: 23,040 bytes per token; 2.8 MiB holds 8 blocks = 128 tokens of the 512.
    return [run_kvserve(make_llm(kv_cache_memory=budget, offload_memory="64MiB", enable_prefix_caching=False),
                        [prompt], params, name)
            for budget, name in (("2.8MiB", "offload-4x"), ("64MiB", "fits-on-device"))]


def preemption_modes(make_llm: MakeLLM, ids: list[int], kv_cache_memory: str = "48MiB",
                     num_requests: int = 32, prompt_len: int = 256,
                     max_tokens: int = 192) -> list[BenchSummary]:
    """(c) A KV budget too small for the batch: preempted sequences recomputed vs swapped."""
    prompts = _slices(ids, num_requests, prompt_len)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)] * num_requests
    return [run_kvserve(make_llm(kv_cache_memory=kv_cache_memory, preemption_mode=mode,
                                 enable_prefix_caching=False),
                        prompts, params, f"preempt-{mode}") for mode in ("recompute", "swap")]
