"""The kernels' sliding windows through the engine: tiny random Gemma 3 and Mistral models, whose
window (8) is a fifth of the prompt, give transformers' log-probabilities (fp32, within 1e-4) on
the cpu attention backend and the Triton one (in its interpreter on the CPU) through chunked
prefill, decode and prefix-cache hits, as tests/model/test_gemma3.py checks the torch backend;
the fused CPU decoder stack declines them, saying why in the log."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from kvserve import LLM, SamplingParams
from kvserve.attention.selector import BACKENDS
from kvserve.cache.kv_pool import KVPool
from tests.model.test_architectures import CPU, assert_logprobs_equal_hf, save_tiny
from tests.model.test_gemma3 import FAMILIES, OTHER, PROMPT

# Why the fused decoder stack runs neither (engine/cpu_stack.py), as the runner logs it.
STACK_DECLINES = {"gemma3": "Gemma's layer", "mistral": "sliding-window layers (window 8)"}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, PreTrainedModel]]:
    root = tmp_path_factory.mktemp("windowed-kernels")
    return {name: (root / name, save_tiny(FAMILIES[name](), root / name)) for name in STACK_DECLINES}


@pytest.mark.parametrize("family", list(STACK_DECLINES))
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_the_kernels_give_transformers_logits(tiny_models: dict, backend: str, family: str,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """A 40-token prompt in chunks of at most 16 tokens and 32 greedy steps; then the same prompt
    beside another, two of its blocks from the prefix cache, in a step whose sequences differ in length."""
    if (reason := BACKENDS[backend].unsupported(KVPool(1, 1, 16, 1, 32, torch.float32, CPU), CPU)) is not None:
        pytest.skip(f"{backend}: {reason}")
    path, hf = tiny_models[family]
    with caplog.at_level(logging.INFO, logger="kvserve.engine.model_runner"):
        llm = LLM(model=str(path), dtype="float32", device="cpu", attention_backend=backend, kv_cache_memory="4MiB",
                  max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16, enable_prefix_caching=True)
    assert isinstance(llm.engine.attention_backend, BACKENDS[backend])
    assert f"the decoder layers run one by one from Python: {STACK_DECLINES[family]}" in caplog.text
    scored = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=-1, prompt_logprobs=-1)
    first = llm.generate([PROMPT], scored, use_tqdm=False)[0]
    assert_logprobs_equal_hf(hf, PROMPT, first, scored_prompt=True)
    stats = llm.engine.block_manager.prefix_stats
    cached = stats.cached_tokens
    again = llm.generate([PROMPT, OTHER], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=-1),
                         use_tqdm=False)
    assert stats.cached_tokens - cached == 32
    for prompt, out in ((PROMPT, again[0]), (OTHER, again[1])):
        assert_logprobs_equal_hf(hf, prompt, out, scored_prompt=False)
