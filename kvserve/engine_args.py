"""Engine options on the command line: one per field of each part of `EngineConfig`, shared by
every command that builds an engine (generate, chat, serve, bench, eval)."""
from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import Field
from typing import Any

from kvserve.config import PARTS, option_fields


def _memory(text: str) -> str | float:
    try:
        return float(text)
    except ValueError:
        return text


# How each option's annotated type is read from the command line.
_PARSERS: dict[str, Callable[[str], Any]] = {
    "int": int, "int | None": int, "float": float, "str": str, "str | None": str,
    "str | float": _memory, "str | Path | ModelConfig | None": str}


def _engine_flags() -> list[tuple[str, Field[Any], str]]:
    """(part, field, argparse dest) for every option of every part; a field's metadata may rename
    its flag."""
    return [(part, f, f.metadata.get("flag", f.name).replace("-", "_"))
            for part, cls in PARTS.items() for f in option_fields(cls)]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One option per field of each part of EngineConfig, named after it, with the field's help
    and default, in one argument group per part. The help shows the default at help time
    (`%(default)s`), so a command's own `set_defaults` (doctor's smaller pool) is what its --help
    says."""
    groups = {part: p.add_argument_group(f"engine: {part.replace('_', ' ').replace('kv', 'KV')} "
                                         f"({cls.__name__})") for part, cls in PARTS.items()}
    for part, f, dest in _engine_flags():
        g = groups[part]
        flag = "--" + dest.replace("_", "-")
        if f.type == "bool":
            g.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=f.default,
                           help=f.metadata["help"] + " (default: %(default)s)")
            continue
        shown = "" if f.default is None else " (default: %(default)s)"
        g.add_argument(flag, dest=dest, type=_PARSERS[str(f.type)], default=f.default,
                       choices=f.metadata.get("choices"), help=f.metadata["help"] + shown)


def flag_names(message: str) -> str:
    """A configuration error as a command-line user reads it: each field named by its option."""
    flags = {f.name: "--" + dest.replace("_", "-") for _, f, dest in _engine_flags()}
    owners = "|".join(["EngineConfig"] + [cls.__name__ for cls in PARTS.values()])
    return re.sub(rf"\b(?:{owners})\.(\w+)", lambda m: flags.get(m.group(1), m.group(0)), message)


def engine_kwargs(args: argparse.Namespace, cache_mode: str | None = None, **overrides: Any) -> dict[str, Any]:
    """The engine options the command line gave (flags renamed by metadata read back), with overrides."""
    kwargs = {f.name: getattr(args, dest) for _, f, dest in _engine_flags()}
    if cache_mode is not None:
        kwargs["cache_mode"] = cache_mode
    if cache_mode not in (None, "paged"):
        # A baseline beside the paged run of the same options: it has no blocks to swap or offload.
        kwargs |= {"preemption_mode": "recompute", "offload_memory": "0"}
    return {**kwargs, **overrides}


def llm_from_args(args: argparse.Namespace, cache_mode: str | None = None, **overrides: Any) -> Any:
    from kvserve import LLM
    return LLM(**engine_kwargs(args, cache_mode, **overrides))


def kv_format_overrides(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    """A format as benchmark and eval lists write it: `name`, or `name@residual` for its own
    full-precision window."""
    name, _, residual = spec.partition("@")
    return {"kv_cache_dtype": name, "kv_residual": int(residual) if residual else args.kv_residual}
