"""An engine on a model with sliding-window layers: what it runs and what it refuses before a step
(a combination not built is refused naming the field, never inside a batch's step)."""
from __future__ import annotations

import dataclasses

import pytest

from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu_extension
from kvserve.validate import FieldError
from tests.conftest import TINY

WINDOWED = dataclasses.replace(TINY, sliding_window=8, sliding_layers=(0,))
BASE = {"model": WINDOWED, "dtype": "float32", "device": "cpu", "kv_cache_memory": "4MiB", "max_model_len": 256}


def test_auto_backend_masks_the_window_on_the_cpu_kernel_where_compiled() -> None:
    llm = LLM(**BASE)
    assert llm.engine.attention_backend.name == ("cpu" if cpu_extension.load() is not None else "torch")
    out = llm.generate([list(range(1, 40))], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].token_ids) == 4


def test_eviction_is_refused_at_start_up_and_per_request() -> None:
    with pytest.raises(FieldError) as caught:
        LLM(**BASE, kv_eviction="window", kv_budget=32)
    assert caught.value.field == "kv_eviction"
    llm = LLM(**BASE)
    with pytest.raises(FieldError) as caught:
        llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, kv_eviction="window", kv_budget=32))
    assert caught.value.field == "kv_eviction"
    assert not llm.engine.has_unfinished()


def test_preemption_and_chunked_prefill_keep_a_windowed_models_tokens() -> None:
    """Four 40-token prompts (past the window of 8) through a pool of ten blocks (preempting by
    recompute) and through a roomy one, in chunks of 16 tokens: the same greedy tokens. A prompt is
    admitted with 4 blocks (3 full, 1 sliding) and a sequence grows to 6 or 7 (4 full; the window,
    and a 16-token chunk, sliding), so two admitted together outgrow the 9 left beside the null block."""
    prompts = [[(7 * i + j) % 127 + 1 for j in range(40)] for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    roomy = LLM(**BASE)
    want = [o.token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(**{**BASE, "num_blocks_override": 10, "max_num_batched_tokens": 16, "max_num_seqs": 4,
                   "max_model_len": 80})
    got = [o.token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert tight.engine.scheduler.num_preemptions > 0


def test_a_request_that_could_never_run_alone_is_refused_not_looped() -> None:
    """Six blocks hold 5 after the null block: a 40-token prompt's peak of 6 (3 full blocks; the
    window and a 16-token chunk in 3 sliding ones) could never run, so the request is refused
    naming the field (it would otherwise preempt itself forever)."""
    tight = LLM(**{**BASE, "num_blocks_override": 6, "max_num_batched_tokens": 16, "max_num_seqs": 4,
                   "max_model_len": 80})
    with pytest.raises(FieldError) as caught:
        tight.engine.add_request(list(range(1, 41)), SamplingParams(max_tokens=24))
    assert caught.value.field == "prompt" and "device KV pool (5 blocks" in str(caught.value)
    assert not tight.engine.has_unfinished()
