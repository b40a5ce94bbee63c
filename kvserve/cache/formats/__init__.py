"""KV storage formats (`kv_cache_dtype`): how one block of K or V is laid out, encoded and decoded.

base.py: the `KVFormat` interface; layout.py: `PageLayout`, what a format's pages are to a kernel;
options.py: the engine's format settings; registry.py: the one table of names; builtin.py: the
formats kvserve ships (plain.py, absmax.py, fitted.py, grouped.py, kivi.py, unroped.py, vector.py,
sparse.py); codes.py: the quantization arithmetic they share. Importing this package registers the built-ins.
"""
from kvserve.cache.formats import builtin  # noqa: F401  (registers the built-in formats)
from kvserve.cache.formats.base import FieldSpec, Fields, KVFormat, PerTokenFormat
from kvserve.cache.formats.layout import PageKind, PageLayout
from kvserve.cache.formats.options import FP8_SCALES, ROLES, FormatOptions, Role, check_format_options
from kvserve.cache.formats.registry import (
    FORMAT_CHOICES,
    DefaultList,
    FormatEntry,
    FormatFactory,
    format_entry,
    format_names,
    make_format,
    register,
    registered,
)

__all__ = ["FieldSpec", "Fields", "KVFormat", "PerTokenFormat", "PageKind", "PageLayout", "FP8_SCALES", "ROLES",
           "FormatOptions", "Role", "check_format_options", "FORMAT_CHOICES", "DefaultList", "FormatEntry",
           "FormatFactory", "format_entry", "format_names", "make_format", "register", "registered"]
