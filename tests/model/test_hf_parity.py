"""Our Llama decoder on the bundled GGUF against HF transformers' LlamaForCausalLM (same file)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention import StepAttention, StepMetadata

pytestmark = pytest.mark.model

PROMPTS = [
    "What is the capital of France?",
    "Tell me a story",
    "Hello",
    "The quick brown fox jumps over the lazy dog and then",
    "1 2 3 4 5",
    "def fibonacci(n):",
    "Paris is",
    "Once upon a time in a land far away, there lived a wise old owl who knew every secret of the",
]


def test_packed_prefill_logits_match_hf(smol: LLM, hf_smol: Any) -> None:
    engine = smol.engine
    prompts = [smol.tokenizer.encode(p) for p in PROMPTS[:4]]
    lens = [len(p) for p in prompts]
    for i, n in enumerate(lens):
        assert engine.block_manager.allocate(f"parity-{i}", n) is not None
    try:
        step = StepMetadata.build(lens, lens, [engine.block_manager.tables[f"parity-{i}"]
                                               for i in range(len(lens))],
                                  engine.pool.block_size, engine.device)
        with torch.inference_mode():
            ours = engine.model(torch.tensor(sum(prompts, [])), StepAttention.of(engine.attention_backend, step),
                                torch.arange(sum(lens)), engine.runner.ops)
            ref = torch.cat([hf_smol(torch.tensor([p])).logits[0] for p in prompts])
    finally:
        for i in range(len(lens)):
            engine.block_manager.free(f"parity-{i}")
    assert (ours - ref).abs().max().item() < 2e-3


def test_continuous_batching_greedy_equals_hf(hf_smol: Any) -> None:
    # max_num_seqs=3 with 8 prompts: sequences finish and new ones join mid-run.
    llm = LLM(dtype="float32", device="cpu", kv_cache_memory="256MiB", max_model_len=1024, max_num_seqs=3)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        with torch.inference_mode():
            ref = hf_smol.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                                   do_sample=False, pad_token_id=2)[0, ids.shape[1]:].tolist()
        assert out.token_ids == ref, prompt
    assert llm.engine.kv_usage().used == 0


@pytest.mark.parametrize("mode", ["no-cache", "contiguous"])
def test_real_model_cached_equals_baselines(smol: LLM, mode: str) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    other = LLM(dtype="float32", device="cpu", kv_cache_memory="256MiB", max_model_len=256, cache_mode=mode)
    expected = [o.token_ids for o in smol.generate(PROMPTS[:3], params, use_tqdm=False)]
    assert [o.token_ids for o in other.generate(PROMPTS[:3], params, use_tqdm=False)] == expected
    assert other.engine.kv_usage().used == 0
