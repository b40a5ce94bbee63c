"""Shared fixtures: tiny random-weight engines for speed, the real model for parity."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

# Without a GPU the Triton backend's kernels run in Triton's interpreter (CPU tensors, numpy):
# slow, so tests keep them to small shapes, and "auto" never picks it on the CPU. Set before
# anything imports triton, which reads it when a kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvserve import LLM  # noqa: E402
from kvserve.model.config import ModelConfig

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position=512)


def assert_all_blocks_free(llm: LLM) -> None:
    usage = llm.engine.kv_usage()
    assert usage.used == 0 and usage.free + usage.cached == usage.total, usage
    bm = llm.engine.block_manager
    assert not bm.tables and all(b.ref_count == 0 for b in bm.blocks)


@pytest.fixture
def tiny_llm() -> Iterator[Callable[..., LLM]]:
    """Builds engines on the same random tiny model; checks each leaked no block."""
    made: list[LLM] = []

    def make(**kwargs: Any) -> LLM:
        kwargs = {"model": TINY, "dtype": "float32", "device": "cpu", "kv_cache_memory": "4MiB",
                  "max_model_len": 256, **kwargs}
        llm = LLM(**kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert_all_blocks_free(llm)


@pytest.fixture(scope="session")
def smol() -> Iterator[LLM]:
    """The bundled SmolLM2-135M-Instruct in fp32, for exact comparison with HF transformers."""
    llm = LLM(dtype="float32", device="cpu", kv_cache_memory="512MiB", max_model_len=2048)
    yield llm
    assert_all_blocks_free(llm)


@pytest.fixture(scope="session")
def hf_smol() -> Any:
    from kvserve.bench.hf_baseline import load_hf_model
    from kvserve.model.loader import default_model_path
    model, _ = load_hf_model(str(default_model_path()), torch.float32)
    return model
