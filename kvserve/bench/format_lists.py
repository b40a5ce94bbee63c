"""The formats a benchmark runs when none is named: the model dtype and the registry's bench
formats (`format_names(default_in="bench")`), read when the parser is built."""
from __future__ import annotations

from kvserve.cache.formats import format_entry, format_names, make_format

# `bench kv-formats` compares capacity at one budget: a format with a full-precision window by
# default runs with this short one instead, whose staging (max_num_seqs x its blocks) comes out of
# the same budget, so the window does not decide the comparison.
KV_FORMATS_RESIDUAL = 32


def kv_formats_defaults() -> list[str]:
    """`bench kv-formats`: each bench format, as `name@residual` where it keeps a window by default."""
    return ["auto", *(f"{n}@{KV_FORMATS_RESIDUAL}" if format_entry(n).default_residual else n
                      for n in format_names(default_in="bench"))]


def attention_formats() -> list[str]:
    """`bench attention`: the bench formats its one layer can time, those encoded token by token."""
    return ["auto", *(n for n in format_names(default_in="bench") if make_format(n, "k").per_token)]
