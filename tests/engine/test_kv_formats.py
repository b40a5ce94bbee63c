"""Generation end to end with compressed KV pages, on the tiny random model (head_dim 16, so
group-wise formats use groups of 16)."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cache.kv_format import FORMAT_NAMES, make_format
from kvserve.cache.kv_pool import KVPool
from kvserve.cache.quantized_pool import QuantizedKVPool
from kvserve.config import EngineConfig
from kvserve.eval.quality import forced_logprobs
from tests.conftest import TINY

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8] * 5, [9, 10, 11], [1, 2, 3, 4, 5, 6, 7, 8] * 5 + [12, 13]]
GROUP = 16


def budget(fmt: str, blocks: int, residual: int, max_num_seqs: int) -> str:
    """Bytes for exactly `blocks` compressed blocks plus the staging the pool will reserve."""
    k, v = make_format(fmt, "k", group_size=GROUP), make_format(fmt, "v", group_size=GROUP)
    block = QuantizedKVPool.bytes_per_block(TINY.num_layers, 16, TINY.num_kv_heads, TINY.head_dim, k, v)
    staging = QuantizedKVPool.staging_slots(max_num_seqs, 16, residual, k, v)
    dense = KVPool.bytes_per_block(TINY.num_layers, 16, TINY.num_kv_heads, TINY.head_dim, torch.float32)
    return str(blocks * block + staging * dense)


@pytest.mark.parametrize("fmt", [f for f in FORMAT_NAMES if f != "fp32"])
def test_every_format_generates_with_prefix_caching_and_preemption(tiny_llm: Callable[..., LLM], fmt: str) -> None:
    # 9 blocks of 16 tokens cannot hold three sequences of 40-66 tokens at once: someone is
    # preempted. The third prompt shares its first two blocks with the first (a prefix-cache hit).
    llm = tiny_llm(kv_cache_dtype=fmt, kv_group_size=GROUP, kv_residual=16, max_num_seqs=3,
                   kv_cache_memory=budget(fmt, 9, residual=16, max_num_seqs=3))
    assert llm.engine.block_manager.num_blocks == 9
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [24] * 3
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.prefix_stats.cached_tokens > 0


def test_residual_covering_the_context_equals_the_dense_cache(tiny_llm: Callable[..., LLM]) -> None:
    """With every token inside the full-precision window the int4 pages are never read, so the
    next-token distributions must be exactly the dense cache's; with no window they must not."""
    windows = [[(7 * i + 3 * j) % 128 for j in range(80)] for i in range(3)]

    def logprobs(**kwargs: object) -> torch.Tensor:
        return forced_logprobs(tiny_llm(max_num_seqs=3, **kwargs), windows, prefill_len=30)

    dense = logprobs()
    assert torch.equal(logprobs(kv_cache_dtype="int4", kv_group_size=GROUP, kv_residual=256), dense)
    assert (logprobs(kv_cache_dtype="int4", kv_group_size=GROUP) - dense).abs().max() > 1e-4


def test_same_budget_holds_more_tokens(tiny_llm: Callable[..., LLM]) -> None:
    dense = tiny_llm(kv_cache_memory="1MiB").engine
    int4 = tiny_llm(kv_cache_memory="1MiB", kv_cache_dtype="int4", kv_group_size=GROUP).engine
    # Per token and KV head: fp32 stores 16 dims * 4 B = 64 B; int4 g16 stores 8 B of codes and
    # one fp16 scale and zero-point (4 B) = 12 B.
    assert int4.kv_bytes_per_token == dense.kv_bytes_per_token * 12 / 64
    assert int4.block_manager.num_blocks == 2**20 // round(dense.kv_bytes_per_token * 12 / 64 * 16)
    # Keys in groups of 8 (8 B of codes + 2 x 4 B), values of 16 (12 B): 28 B where fp32 takes 128 B.
    roles = tiny_llm(kv_cache_memory="1MiB", kv_cache_dtype="int4", kv_group_size_k=8, kv_group_size_v=16).engine
    assert roles.kv_bytes_per_token == dense.kv_bytes_per_token * 28 / 128


@pytest.mark.parametrize("kwargs, field", [
    ({"kv_cache_dtype": "int3"}, "kv_cache_dtype"),
    ({"kv_cache_dtype_v": "nope"}, "kv_cache_dtype_v"),
    ({"kv_cache_dtype": "int8", "preemption_mode": "swap"}, "preemption_mode"),
    ({"kv_cache_dtype": "int8", "offload_memory": "1MiB"}, "offload_memory"),
    ({"kv_cache_dtype": "int4", "kv_group_size": 3}, "kv_group_size"),
    ({"kv_cache_dtype": "int4", "kv_group_size_v": 3}, "kv_group_size_v"),
    ({"kv_cache_dtype": "kivi4", "kv_group_size_v": 200}, "kv_group_size_v"),
    ({"kv_residual": -1}, "kv_residual"),
])
def test_bad_format_settings_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)
