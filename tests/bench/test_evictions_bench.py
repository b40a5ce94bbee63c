"""`kvserve bench evictions` at a budget where evicting sequences fit more at once."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # two engines on the real model: ~1 min; the CI suite is near its 10-minute limit
def test_evictions_bench_runs_more_sequences_at_once(tmp_path: Path) -> None:
    # 6 prompts of ~160 tokens in a pool of 40 blocks of 16: about 4 fit at once whole, all 6
    # once each keeps 48 tokens.
    done = subprocess.run(
        [sys.executable, "-m", "kvserve", "bench", "evictions", "--policies", "none,window", "--kv-budget", "48",
         "--num-requests", "6", "--prompt-len-median", "160", "--output-len-median", "8",
         "--kv-cache-memory", f"{40 * 16 * 23040}B", "--max-model-len", "1024", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in (tmp_path / "evictions.md").read_text().splitlines()
            if line.startswith("| kvserve ")]
    peaks = [float(row.split("|")[4].split()[0]) for row in rows[-2:]]
    assert rows[-2].startswith("| kvserve none") and rows[-1].startswith("| kvserve window @48")
    means = [float(row.split("|")[5].split()[0]) for row in rows[-2:]]  # time-weighted
    assert peaks[1] > peaks[0] and means[1] > means[0], rows
