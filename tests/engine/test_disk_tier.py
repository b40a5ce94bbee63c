"""A prefix cache that survives a restart (kv_disk_dir): an engine stopped and started again on
the same directory serves a long prompt's prefix from disk, with the tokens and logprobs of a
fresh compute in fp32 (dense and int8 pages); a damaged directory costs a counted skip, never a
wrong answer."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cache.blocks import block_hash

PROMPT = [(13 * i + 7) % 120 + 4 for i in range(90)]
PARAMS = SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True)
PAGES = {"dense": {}, "int8": {"kv_cache_dtype": "int8", "kv_residual": 0}}


def answer(llm: LLM) -> tuple[list[int], torch.Tensor, int]:
    out = llm.generate(PROMPT, PARAMS, use_tqdm=False)[0]
    return out.token_ids, torch.tensor([lp.logprob for lp in out.logprobs]), out.num_cached_tokens


@pytest.mark.parametrize("pages", list(PAGES))
def test_a_restart_serves_the_prefix_from_disk(tiny_llm: Callable[..., LLM], tmp_path: Path, pages: str) -> None:
    options: dict[str, Any] = {"kv_disk_dir": str(tmp_path), **PAGES[pages]}
    fresh_tokens, fresh_logprobs, _ = answer(tiny_llm(**PAGES[pages]))
    first = tiny_llm(**options)
    tokens, _, cached = answer(first)
    assert tokens == fresh_tokens and cached == 0
    assert first.engine.remote.stats.stored == (len(PROMPT) + PARAMS.max_tokens - 1) // 16  # every computed block
    first.engine.close()
    restarted = tiny_llm(**options)
    tokens, logprobs, cached = answer(restarted)
    assert cached == (len(PROMPT) - 1) // 16 * 16  # every full block before the last token, from disk
    assert tokens == fresh_tokens
    torch.testing.assert_close(logprobs, fresh_logprobs, rtol=0, atol=1e-5)
    assert restarted.engine.remote.stats.hits == cached // 16
    restarted.engine.close()


def test_a_damaged_file_is_skipped_and_the_answer_stays_right(tiny_llm: Callable[..., LLM], tmp_path: Path) -> None:
    fresh = answer(tiny_llm())
    first = tiny_llm(kv_disk_dir=str(tmp_path))
    answer(first)
    first.engine.close()
    parent = None
    for i in range(3):  # the prompt's third block, by its chain hash
        parent = block_hash(parent, tuple(PROMPT[16 * i:16 * (i + 1)]))
    third = next(tmp_path.glob(f"*/{parent.hex()}.kvb"))
    data = bytearray(third.read_bytes())
    data[len(data) // 2] ^= 0xFF
    third.write_bytes(bytes(data))
    restarted = tiny_llm(kv_disk_dir=str(tmp_path))
    tokens, logprobs, cached = answer(restarted)
    assert tokens == fresh[0] and cached == 2 * 16  # the two blocks before the damaged one
    torch.testing.assert_close(logprobs, fresh[1], rtol=0, atol=1e-5)
    assert restarted.engine.remote.stats.corrupt == 1
    restarted.engine.close()


def test_two_engines_cannot_share_a_directory(tiny_llm: Callable[..., LLM], tmp_path: Path) -> None:
    first = tiny_llm(kv_disk_dir=str(tmp_path))
    with pytest.raises(ValueError, match="kv_disk_dir"):
        tiny_llm(kv_disk_dir=str(tmp_path))
    first.engine.close()


def test_a_failed_start_gives_the_directory_up(tiny_llm: Callable[..., LLM], tmp_path: Path) -> None:
    """An engine whose construction fails after its disk tier was made (here: the KV events port
    is taken) releases the directory at once, not when the tier is collected."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(Exception) as failed:  # its traceback keeps the failed start's frames alive
            tiny_llm(kv_disk_dir=str(tmp_path), kv_events_publisher="zmq",
                     kv_events_endpoint=f"tcp://127.0.0.1:{taken.getsockname()[1]}")
    finally:
        taken.close()
    tiny_llm(kv_disk_dir=str(tmp_path)).engine.close()  # the lock is free all the same
    assert failed.traceback

