"""Synthetic request workloads built from a text's token ids (kvserve.texts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvserve.measure.request_lengths import lognormal_lengths
from kvserve.texts import load_text


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class WorkloadRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def load_text_ids(tokenizer: Encoder, spec: str | None = None, max_chars: int = 200_000) -> tuple[str, list[int]]:
    """(the text's name, token ids of its first `max_chars` characters). ~200k characters give
    ~50k tokens: plenty of distinct slices, where tokenizing a whole file would dominate start-up."""
    text = load_text(spec, max_chars)
    return text.name, tokenizer.encode(text.text, add_special_tokens=False)


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
