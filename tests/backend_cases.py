"""Backend parametrizations that keep the Triton interpreter's share of CI small.

Without a GPU the Triton kernels run interpreted (numpy, one program at a time): seconds per
case. Their heavier cases are marked slow there (CI skips them; `pytest -m slow` runs them); on
a GPU every case runs.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

INTERPRETED = not torch.cuda.is_available()


def heavy_case(*values: Any, backend: str, id: str | None = None) -> Any:
    """pytest.param(*values), marked slow when it would run `backend` in the Triton interpreter."""
    slow = backend == "triton" and INTERPRETED
    return pytest.param(*values, id=id, marks=[pytest.mark.slow] if slow else [])
