"""Type checks shared by the validated dataclasses (EngineConfig, SamplingParams, EvictionPolicy)."""
from __future__ import annotations


def is_int(value: object) -> bool:
    """An integer and not a bool (True is an int to Python, never a count or a token id here)."""
    return isinstance(value, int) and not isinstance(value, bool)
