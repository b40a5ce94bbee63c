"""Checks shared by the validated dataclasses (EngineConfig, SamplingParams, EvictionPolicy) and the
engine's and server's request validation."""
from __future__ import annotations


def is_int(value: object) -> bool:
    """An integer and not a bool (True is an int to Python, never a count or a token id here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_utf8(name: str, text: str) -> None:
    """Raises ValueError naming `name` if `text` holds a lone surrogate: JSON allows "\\ud800", and
    such a str breaks the tokenizer and the salt hash later, inside the step, where it would fail
    every request of the batch."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name}: not valid Unicode (lone surrogate at character {e.start})") from None
