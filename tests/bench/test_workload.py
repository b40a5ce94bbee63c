from pathlib import Path

import numpy as np

from kvserve.bench.workload import WorkloadRequest, load_text_ids, make_workload

IDS = list(range(50_000))


def test_same_seed_same_workload() -> None:
    assert make_workload(IDS, 50, seed=7) == make_workload(IDS, 50, seed=7)
    assert make_workload(IDS, 50, seed=7) != make_workload(IDS, 50, seed=8)


def test_lengths_within_bounds() -> None:
    requests = make_workload(
        IDS, 2000, seed=0, max_prompt_len=300, max_output_len=100, min_len=4
    )
    assert len(requests) == 2000
    assert all(isinstance(r, WorkloadRequest) for r in requests)
    assert all(4 <= len(r.prompt_token_ids) <= 300 for r in requests)
    assert all(4 <= r.max_tokens <= 100 for r in requests)


def test_lengths_are_long_tailed_around_median() -> None:
    requests = make_workload(IDS, 5000, seed=1, max_prompt_len=10_000, max_output_len=10_000)
    for lengths, median in (
        (np.array([len(r.prompt_token_ids) for r in requests]), 128),
        (np.array([r.max_tokens for r in requests]), 64),
    ):
        assert abs(np.median(lengths) - median) < 0.1 * median
        # A right-skewed distribution has its mean above its median.
        assert lengths.mean() > 1.2 * np.median(lengths)


def test_prompts_are_contiguous_slices() -> None:
    # With ids 0..N-1, a contiguous slice is a run of consecutive integers.
    for r in make_workload(IDS, 200, seed=3):
        start = r.prompt_token_ids[0]
        assert r.prompt_token_ids == IDS[start : start + len(r.prompt_token_ids)]


def test_prompt_len_capped_by_available_ids() -> None:
    short = list(range(10))
    requests = make_workload(short, 100, seed=0, prompt_len_median=64)
    assert all(len(r.prompt_token_ids) <= 10 for r in requests)


class _CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return [ord(c) for c in text]


def test_load_text_ids_truncates(tmp_path: Path) -> None:
    path = tmp_path / "wiki.raw"
    path.write_text("abcdef", encoding="utf-8")
    assert load_text_ids(_CharTokenizer(), str(path), max_chars=4) == (path.name, [97, 98, 99, 100])
