"""The bench command line: HF's dtype follows --dtype unless --hf-dtype names another, and every
dtype alias --dtype accepts reaches torch (on a CPU with bf16 instructions: without them HF's bf16
becomes float32, tests/bench/test_serve_peers.py)."""
from __future__ import annotations

import pytest
import torch

from kvserve.bench import peer_weights
from kvserve.bench.cli import _hf_dtype
from kvserve.cli import build_parser


@pytest.mark.parametrize("bench", ["throughput", "scaling", "serve"])
@pytest.mark.parametrize(("argv", "want"), [
    ([], torch.bfloat16),
    (["--dtype", "bf16"], torch.bfloat16),
    (["--dtype", "fp32"], torch.float32),
    (["--hf-dtype", "float32"], torch.float32),
    (["--dtype", "float32", "--hf-dtype", "bf16"], torch.bfloat16),
])
def test_hf_runs_in_its_own_dtype_or_the_engines(bench: str, argv: list[str], want: torch.dtype,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peer_weights, "cpu_flags", lambda: {"avx512_bf16"})
    assert _hf_dtype(build_parser().parse_args(["bench", bench, *argv])) == want
