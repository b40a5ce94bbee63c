"""Sequences longer than the device KV pool: cold blocks offloaded to host and read back."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from kvserve import LLM, SamplingParams


def run_tracking_offload(llm: LLM, prompt: list[int] | str, params: SamplingParams) -> tuple[list[int], int]:
    engine = llm.engine
    engine.add_request(prompt, params)
    most, out = 0, None
    while engine.has_unfinished():
        for o in engine.step():
            out = o
        most = max(most, engine.kv_usage().offloaded)
    return out.token_ids, most


def test_sequence_four_times_the_device_budget_completes(tiny_llm: Callable[..., LLM]) -> None:
    prompt = list(range(3, 23))
    params = SamplingParams(max_tokens=236, temperature=0, ignore_eos=True)  # 256 tokens
    reference = tiny_llm().generate([prompt], params, use_tqdm=False)[0].token_ids
    # 32 KiB = 4 blocks of 16 tokens = 64 tokens on the device: a quarter of the sequence.
    small = tiny_llm(kv_cache_memory="32KiB", offload_memory="1MiB", enable_prefix_caching=False)
    tokens, most_offloaded = run_tracking_offload(small, prompt, params)
    assert tokens == reference
    assert most_offloaded == 256 // 16 - 4  # all but the 4 newest blocks lived on the host
    bm = small.engine.block_manager
    assert bm.num_host_blocks == 128 and len(bm._host_free) == 128  # 1 MiB / 8 KiB, all back
    assert small.engine.kv_usage().offloaded == 0


def test_too_long_without_offload_is_rejected(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm(kv_cache_memory="32KiB")
    with pytest.raises(ValueError, match="whole KV cache"):
        llm.engine.add_request(list(range(3, 23)), SamplingParams(max_tokens=236))
    with pytest.raises(ValueError, match="device KV pool"):
        tiny_llm(kv_cache_memory="32KiB", offload_memory="1MiB").engine.add_request(
            list(range(1, 80)), SamplingParams(max_tokens=4))


@pytest.mark.model
def test_real_model_long_generation_with_offload(smol: LLM) -> None:
    prompt = "Write a long story about a lighthouse keeper."
    params = SamplingParams(max_tokens=128 - len(smol.tokenizer.encode(prompt)), temperature=0,
                            ignore_eos=True)
    reference = smol.generate([prompt], params, use_tqdm=False)[0].token_ids
    # fp32 SmolLM2: 46,080 bytes per token, 737,280 per 16-token block; 3 MiB holds 4 blocks,
    # 64 tokens: half of the 128-token sequence.
    small = LLM(dtype="float32", device="cpu", kv_cache_memory="3MiB", offload_memory="64MiB",
                max_model_len=512, enable_prefix_caching=False)
    assert small.engine.block_manager.num_blocks == 4
    tokens, most_offloaded = run_tracking_offload(small, prompt, params)
    assert tokens == reference and most_offloaded > 0


def test_long_sequence_beside_others_is_offloaded_not_preempted(tiny_llm: Callable[..., LLM]) -> None:
    short = [list(range(30, 40)), list(range(50, 60))]
    long_prompt = list(range(3, 23))
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)] * 2 + [
        SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)]
    reference = [o.token_ids for o in tiny_llm().generate(short + [long_prompt], params, use_tqdm=False)]
    small = tiny_llm(kv_cache_memory="64KiB", offload_memory="1MiB", enable_prefix_caching=False)
    outs = small.generate(short + [long_prompt], params, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference


def test_beams_are_held_to_the_device_pool_with_offload_on(tiny_llm: Callable[..., LLM]) -> None:
    """Beams are never offloaded (they run together): three beams of 70 tokens fit the device pool
    (96 tokens) plus its host tier, but once preempted they could never come back, and the
    request waited forever. They are refused; beams that fit the device run beside the tier."""
    llm = tiny_llm(kv_cache_memory="48KiB", offload_memory="256KiB")  # 6 blocks of 16 on the device
    with pytest.raises(ValueError, match="beam_width: 3 beams of up to 70 tokens must fit the device KV pool"):
        llm.engine.add_request(list(range(3, 43)), SamplingParams(beam_width=3, max_tokens=30, ignore_eos=True))
    outs = llm.generate([list(range(3, 23))], SamplingParams(beam_width=3, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    assert len(outs[0].token_ids) == 12
