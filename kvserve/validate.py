"""Checks shared by the validated dataclasses (EngineConfig, SamplingParams, EvictionPolicy) and the
engine's and server's request validation."""
from __future__ import annotations


class FieldError(ValueError):
    """A value refused, carrying the field or parameter it names, so that the CLI (its flag) and the
    server (the OpenAI error's `param`) name it without parsing the message."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


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
        raise FieldError(name, f"{name}: not valid Unicode (lone surrogate at character {e.start})") from None
