"""What every part of the engine's configuration shares: fields that carry their command-line
help (kvserve.engine_args derives the options from them), a check of every field against its
annotated type, run first on construction so a part's own checks may rely on it, and byte sizes."""
from __future__ import annotations

import functools
import re
import typing
from dataclasses import Field, field, fields
from typing import Any

from kvserve.validate import FieldError, is_int

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15}


def opt(default: object, help: str, **cli: object) -> Any:
    """A field with the help its command-line option shows; `cli` may rename the flag (`flag`),
    list its `choices`, or mark a byte size given as a string (`size`)."""
    return field(default=default, metadata={"help": help, **cli})


def parse_bytes(text: str, name: str = "kv_cache_memory", owner: str = "CacheOptions") -> int:
    """'2GiB', '512MiB', '1.5GB' or '0' in bytes; an error names `owner`.`name`."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise FieldError(name, f"{owner}.{name}: cannot parse {text!r} (use e.g. '2GiB' or 0.5)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


class Options:
    """A part of the configuration: a frozen dataclass whose fields are type-checked, then checked
    by the part's own `_check`, on construction. Errors name `<Part>.<field>`."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for f in fields(self):  # type: ignore[arg-type]
            value, allowed = getattr(self, f.name), _field_types(type(self))[f.name]
            if not any(_is_a(value, t) for t in allowed):
                names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
                got = repr(value) if f.repr else f"a value of type {type(value).__name__}"  # secrets: not echoed
                if f.metadata.get("size"):
                    names = "a size string such as '4GiB', '512MiB' or '0'"
                    got = f"{got} of type {type(value).__name__}"
                raise FieldError(f.name, f"{owner}.{f.name} must be {names}, got {got}")
        self._check()

    def _check(self) -> None:
        """The part's own ranges and choices (fields of other parts are EngineConfig's to check)."""

    def _positive(self, *names: str) -> None:
        """Each field, an int (or None where its annotation allows it) by the type check, is >= 1."""
        for name in names:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise FieldError(name, f"{type(self).__name__}.{name} must be a positive integer, got {value!r}")

    def _one_of(self, name: str, choices: typing.Iterable[str]) -> None:
        choices = tuple(choices)
        if getattr(self, name) not in choices:
            raise FieldError(name, f"{type(self).__name__}.{name} must be one of {', '.join(choices)}, "
                                   f"got {getattr(self, name)!r}")


def option_fields(part: type[Options]) -> tuple[Field[Any], ...]:
    return fields(part)  # type: ignore[arg-type]


@functools.cache
def _field_types(part: type) -> dict[str, tuple[type, ...]]:
    """Each field's accepted types (the members of a union)."""
    return {name: typing.get_args(hint) or (hint,) for name, hint in typing.get_type_hints(part).items()}


def _is_a(value: object, kind: type) -> bool:
    """`isinstance`, except that a bool is no number and an int is a float."""
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return is_int(value)
    return isinstance(value, kind)
