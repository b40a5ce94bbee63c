"""What an eviction policy lets the prefix cache supply of a prompt, worked by hand."""
from __future__ import annotations

import pytest

from kvserve.eviction.policy import EvictionPolicy


@pytest.mark.parametrize("name, chunk, want", [
    ("h2o", None, 0),          # every prompt query's attention counts
    ("h2o", 16, 0),
    ("snapkv", None, 92),      # its 8-query window before the prompt's end (100) must run
    ("snapkv", 16, 8),         # ...before the first chunk end (16)
    ("window", None, 100),     # no scores: the whole prompt (the block manager keeps its last token)
    ("window", 16, 15),        # a step must end at 16 to evict there
    ("strided", 16, 15),
    ("tova", None, 100),       # the newest query alone: the last token, always computed
    ("tova", 16, 15),
    ("window", 128, 100),      # a chunk past the prompt: judged at its end
])
def test_cacheable_prompt_tokens(name: str, chunk: int | None, want: int) -> None:
    policy = EvictionPolicy(name, budget=24, sink_tokens=2, window=8, observation_window=8, prefill_chunk=chunk)
    assert policy.cacheable(100) == want
    assert policy.cacheable(5) == (0 if name in ("h2o", "snapkv") else 5)  # shorter than a window or a chunk
