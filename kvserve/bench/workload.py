"""Synthetic request workloads built from WikiText-2 token ids."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

# The data lives beside the repo checkout (../shared), not inside it.
DEFAULT_WIKITEXT_PATH = (
    Path(__file__).resolve().parents[2].parent / "shared/data/wikitext-2-raw/wiki.test.raw"
)


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class WorkloadRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def load_wikitext_ids(
    tokenizer: Encoder,
    path: str | os.PathLike[str] = DEFAULT_WIKITEXT_PATH,
    max_chars: int = 200_000,
) -> list[int]:
    # ~200k chars gives ~50k tokens: plenty of distinct slices, and tokenizing
    # the full file would dominate benchmark start-up.
    with open(path, encoding="utf-8") as f:
        text = f.read(max_chars)
    return tokenizer.encode(text, add_special_tokens=False)


def lognormal_lengths(
    rng: np.random.Generator, median: int, sigma: float, n: int, low: int, high: int
) -> np.ndarray:
    # A lognormal's median is exp(mu), so mu = log(median) pins the median
    # while sigma controls the long tail real request lengths show.
    raw = rng.lognormal(mean=math.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(raw), low, high).astype(np.int64)


def make_workload(
    token_ids: list[int],
    num_requests: int,
    seed: int,
    prompt_len_median: int = 128,
    output_len_median: int = 64,
    sigma: float = 0.8,
    max_prompt_len: int = 1024,
    max_output_len: int = 512,
    min_len: int = 4,
) -> list[WorkloadRequest]:
    if len(token_ids) < min_len:
        raise ValueError(f"need at least {min_len} token ids, got {len(token_ids)}")
    rng = np.random.default_rng(seed)
    # A prompt can never be longer than the text it is sliced from.
    prompt_cap = min(max_prompt_len, len(token_ids))
    prompt_lens = lognormal_lengths(rng, prompt_len_median, sigma, num_requests, min_len, prompt_cap)
    output_lens = lognormal_lengths(rng, output_len_median, sigma, num_requests, min_len, max_output_len)
    # Offsets are drawn per request so each slice fits inside the id list.
    offsets = rng.integers(0, len(token_ids) - prompt_lens + 1)
    return [
        WorkloadRequest(prompt_token_ids=list(token_ids[o : o + p]), max_tokens=int(m))
        for o, p, m in zip(offsets.tolist(), prompt_lens.tolist(), output_lens.tolist())
    ]
