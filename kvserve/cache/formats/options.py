"""The engine's format settings (`kv_group_size`, `kv_outliers`, ...) as one value a format's
factory reads: each format takes the settings it uses and ignores the rest."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvserve.validate import FieldError, is_int

Role = Literal["k", "v"]
ROLES: tuple[Role, ...] = ("k", "v")
FP8_SCALES: tuple[str, ...] = ("token", "head")


def check_format_options(group_size: int, outliers: int, sparse_threshold: float, sparse_capacity: float,
                         fp8_scales: str, key_wide_channels: int) -> None:
    """The format settings' own ranges, named as the engine's fields (EngineConfig checks them too,
    whatever its formats)."""
    if not (is_int(group_size) and 4 <= group_size <= 128):
        raise FieldError("kv_group_size",
                         "kv_group_size must be an integer from 4 to 128 that divides head_dim, "
                         f"got {group_size!r}")
    if not (is_int(outliers) and outliers >= 1):
        raise FieldError("kv_outliers", f"kv_outliers must be an integer >= 1, got {outliers!r}")
    if not (isinstance(sparse_threshold, (int, float)) and sparse_threshold >= 0):
        raise FieldError("kv_sparse_threshold", f"kv_sparse_threshold must be >= 0, got {sparse_threshold!r}")
    if not (isinstance(sparse_capacity, (int, float)) and 0 < sparse_capacity <= 1):
        raise FieldError("kv_sparse_capacity", f"kv_sparse_capacity must be in (0, 1], got {sparse_capacity!r}")
    if fp8_scales not in FP8_SCALES:
        raise FieldError("kv_fp8_scales", f"kv_fp8_scales must be one of {', '.join(FP8_SCALES)}, got {fp8_scales!r}")
    if not (is_int(key_wide_channels) and key_wide_channels >= 0 and key_wide_channels % 8 == 0):
        raise FieldError("kv_key_wide_channels",
                         "kv_key_wide_channels must be a multiple of 8 (whole bytes of its bit plane, whole RoPE "
                         f"pairs), got {key_wide_channels!r}")


@dataclass(frozen=True)
class FormatOptions:
    """Checked on construction, whichever format reads them, so a bad setting fails the same way
    for every format. head_dim-dependent checks (group_size divides it, ...) happen in `fields`.
    `fp8_scales` "head": fp8 formats keep one calibrated scale per KV head instead of one per
    token; `exact_sink`: each block's first KIVI key in fp16; `key_wide_channels`: that many KIVI
    key channels per head get one bit more; `symmetric_values`: KIVI values without zero-points."""
    group_size: int = 32
    outliers: int = 4
    sparse_threshold: float = 0.5
    sparse_capacity: float = 0.5
    fp8_scales: str = "token"
    exact_sink: bool = False
    key_wide_channels: int = 0
    symmetric_values: bool = False

    def __post_init__(self) -> None:
        check_format_options(self.group_size, self.outliers, self.sparse_threshold, self.sparse_capacity,
                             self.fp8_scales, self.key_wide_channels)
