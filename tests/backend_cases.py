"""Backend parametrizations that keep the Triton interpreter's share of CI small.

Without a GPU the Triton kernels run interpreted (numpy, one program at a time): seconds per
case. Their heavier cases are marked slow there (CI skips them; `pytest -m slow` runs them); on
a GPU every case runs.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch

INTERPRETED = not torch.cuda.is_available()
# triton is in the test extras for Linux x86-64 only; elsewhere its cases skip.
NO_TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
# What a heavy Triton case carries: slow where the kernels would run interpreted.
INTERPRETED_SLOW = [pytest.mark.slow] if INTERPRETED else []
Test = TypeVar("Test", bound=Callable[..., object])


def backend_device(backend: str) -> str:
    """Where an engine on `backend` runs: Triton's kernels compiled on a GPU when there is one,
    interpreted on the CPU otherwise (a CPU engine refuses them outside the interpreter)."""
    return "cuda" if backend == "triton" and not INTERPRETED else "cpu"


def heavy(test: Test) -> Test:
    """`test`, marked slow where it would run the Triton interpreter (a real model, or a pool that
    preempts: 10-25 s of CI each on 2 cores); on a GPU it runs as it is."""
    for mark in INTERPRETED_SLOW:
        test = mark(test)
    return test


def heavy_case(*values: Any, backend: str, id: str | None = None) -> Any:
    """pytest.param(*values), marked slow when it would run `backend` in the Triton interpreter."""
    marks = [NO_TRITON, *INTERPRETED_SLOW] if backend == "triton" else []
    return pytest.param(*values, id=id, marks=marks)
