"""argparse `type=` readers shared by the commands: argparse names the option in their errors and
exits with a usage error before anything loads."""
from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """A whole number >= minimum (and <= maximum)."""
    def whole_number(text: str) -> int:
        try:
            value: int | None = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            raise argparse.ArgumentTypeError(f"must be a whole number {bounds}, got {text!r}")
        return value
    return whole_number


def number(*, at_least: float | None = None, above: float | None = None) -> Callable[[str], float]:
    """A finite number (nan would compare false with every bound) >= at_least, or > above."""
    def finite(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if (not math.isfinite(value) or (at_least is not None and value < at_least)
                or (above is not None and value <= above)):
            bound = f">= {at_least}" if at_least is not None else f"> {above}" if above is not None else "finite"
            raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text!r}")
        return value
    return finite


def non_empty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


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


def folder(text: str) -> str:
    """An output folder: made if missing, refused up front if a file holds its name (the command
    would otherwise fail only when it writes, after all its work)."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    return text
