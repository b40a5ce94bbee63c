"""The one table of KV formats: each name, how to build its keys' and values' formats, its
full-precision window when `kv_residual` is unset, and the commands that run it by default.

Every list of formats derives from it: the names `EngineConfig`, plan files and the command line
accept (`FORMAT_CHOICES`, a live view argparse reads at parse time), the help that lists them,
`kvserve memory`'s prices (it builds the format and reads its fields), and the formats `kvserve
eval`, `tune-kv` and `bench` run when none is named (`format_names(default_in=...)`).

Why a process-wide table, the one allowed: a format name is read in many places (the
configuration, a plan file, the pool, the planner, eval), and each must resolve it to the same
format; a table handed around would have to reach every one of them. It is kept from leaking
state: the built-ins (builtin.py) register once at import and never leave, and anything else
enters through `registered(...)`, a context manager that takes it out again on exit, so a test's
format never outlives its test.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from kvserve.cache.formats.base import KVFormat
from kvserve.cache.formats.options import ROLES, FormatOptions, Role

FormatFactory = Callable[[Role, FormatOptions], KVFormat]  # (role, the engine's settings) -> format
DefaultList = Literal["eval", "tune", "bench"]  # commands that run a set of formats when none is named
# A name is written in comma-separated lists, as `name@residual`, beside `auto` and `plan:PATH`.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class FormatEntry:
    name: str
    factory: FormatFactory
    default_residual: int = 0  # recent tokens kept in full precision when kv_residual is unset
    default_in: frozenset[DefaultList] = frozenset()


_ENTRIES: dict[str, FormatEntry] = {}


class _RegisteredNames(Collection[str]):
    """The registered names as they are when read, in registration order: argparse checks and lists
    `choices` at parse and help time, so a format registered after a parser was built is one."""

    def __contains__(self, name: object) -> bool:
        return name in _ENTRIES

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(_ENTRIES))

    def __len__(self) -> int:
        return len(_ENTRIES)


FORMAT_CHOICES: Collection[str] = _RegisteredNames()


def register(name: str, factory: FormatFactory, *, default_residual: int = 0,
             default_in: Iterable[DefaultList] = ()) -> FormatEntry:
    """Adds a format for the life of the process (the built-ins); elsewhere use `registered`."""
    if not (isinstance(name, str) and _NAME.fullmatch(name)) or name == "auto":
        raise ValueError(f"format name: letters, digits, '_', '.' and '-' (not 'auto'), got {name!r}")
    if name in _ENTRIES:
        raise ValueError(f"format name: {name!r} is already registered")
    if not (isinstance(default_residual, int) and default_residual >= 0):
        raise ValueError(f"default_residual: must be an integer >= 0, got {default_residual!r}")
    entry = FormatEntry(name, factory, default_residual, frozenset(default_in))
    _ENTRIES[name] = entry
    return entry


@contextmanager
def registered(name: str, factory: FormatFactory, *, default_residual: int = 0,
               default_in: Iterable[DefaultList] = ()) -> Iterator[FormatEntry]:
    """`register` for the duration of a `with` block: the format is gone again on exit."""
    entry = register(name, factory, default_residual=default_residual, default_in=default_in)
    try:
        yield entry
    finally:
        del _ENTRIES[name]


def format_names(default_in: DefaultList | None = None) -> tuple[str, ...]:
    """Every registered name in registration order, or those `default_in` a command's defaults."""
    return tuple(n for n, e in _ENTRIES.items() if default_in is None or default_in in e.default_in)


def format_entry(name: str) -> FormatEntry:
    entry = _ENTRIES.get(name)
    if entry is None:
        raise ValueError(f'kv_cache_dtype: unknown format "{name}"; choose one of {", ".join(_ENTRIES)}')
    return entry


def make_format(name: str, role: str, **settings: int | float | str | bool) -> KVFormat:
    """The format called `name` for keys (role "k") or values (role "v"), built with the engine's
    format settings (`FormatOptions`'s fields; unset ones take its defaults). Every setting is
    checked, whether or not `name` uses it, so a bad configuration fails the same way for every
    format."""
    entry = format_entry(name)
    if role not in ROLES:
        raise ValueError(f'role: must be "k" or "v", got {role!r}')
    return entry.factory(role, FormatOptions(**settings))  # type: ignore[arg-type]
