"""`kvserve bench attention`: what it refuses, and how its table reads."""
from __future__ import annotations

import pytest

from kvserve.attention.selector import BACKENDS
from kvserve.bench.attention import format_rows, time_backends


@pytest.mark.parametrize("fmt", ["kivi2", "kivi4"])
def test_block_formats_are_refused_before_any_timing(fmt: str) -> None:
    with pytest.raises(ValueError, match=f"--formats: {fmt} .*bench kv-formats"):
        time_backends(["int8", fmt])


def test_the_table_gives_each_backend_and_the_torch_over_cpu_speedup() -> None:
    row = {"format": "int8", "shape": "decode 1 x 256", **{name: None for name in BACKENDS},
           "torch": 300.0, "cpu": 100.0}
    line = format_rows([row]).splitlines()[-1]
    assert line.startswith("| int8 | decode 1 x 256 | ") and line.endswith("| 3.0x |") and "| - |" in line
