"""argparse `type=` readers shared by the commands: argparse names the option in their errors and
exits with a usage error before anything loads."""
from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def at_least(minimum: int) -> Callable[[str], int]:
    """A whole number >= minimum."""
    def whole_number(text: str) -> int:
        try:
            value: int | None = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum}, got {text!r}")
        return value
    return whole_number


def one_of(names: Sequence[str]) -> Callable[[str], str]:
    def name(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(names)}")
        return text
    return name


def comma_list(item: Callable[[str], T]) -> Callable[[str], list[T]]:
    """Comma-separated values, each read by `item`; empty ones are skipped, so '' is the empty list."""
    def values(text: str) -> list[T]:
        return [item(x) for x in text.split(",") if x]
    return values
