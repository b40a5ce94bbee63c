"""The KV format part of the configuration: how pages are stored (kvserve.cache.formats), with
the options of the formats, a rotation before them, and the start-up calibration some read."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.attention.rotation import ROTATIONS
from kvserve.cache.formats import FORMAT_CHOICES, FP8_SCALES, KVFormat, check_format_options, format_entry, \
    format_names, make_format
from kvserve.cache.kv_plan import KVPlan, plan_path
from kvserve.config.options import Options, opt
from kvserve.texts import TEXT_NAMES
from kvserve.validate import FieldError

_DTYPE_FORMAT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

FormatPair = tuple[KVFormat, KVFormat]


@dataclass(frozen=True)
class KVFormatOptions(Options):
    kv_cache_dtype: str = opt("auto", "how K/V pages are stored: auto keeps the model dtype; a format name ("
                                      f"{', '.join(format_names())}) stores them in that format; plan:PATH "
                                      "reads a per-layer plan (JSON: {'version': 1, 'layers': [{'k': 'int8', "
                                      "'v': 'int4'}, ...]}), one entry per layer")
    kv_cache_dtype_k: str | None = opt(None, "keys only (default: kv_cache_dtype)", choices=FORMAT_CHOICES)
    kv_cache_dtype_v: str | None = opt(None, "values only (default: kv_cache_dtype)", choices=FORMAT_CHOICES)
    kv_rotation: str = opt("none", "rotate each head's q, k and v before the pages (QuaRot): spreads outlier "
                                   "channels so compressed pages lose less; hadamard (power-of-two head_dim) or "
                                   "random orthogonal", choices=ROTATIONS)
    kv_rotate_keys: bool = opt(True, "with kv_rotation: false rotates values only, so keys keep their outlier "
                                     "channels in place for kv_key_wide_channels to find")
    kv_group_size: int = opt(32, "channels per scale/zero-point for int4, kivi values and outlier (4..128)")
    kv_group_size_k: int | None = opt(None, "keys only (default: kv_group_size)")
    kv_group_size_v: int | None = opt(None, "values only (default: kv_group_size)")
    kv_residual: int | None = opt(None, "recent tokens kept in full precision (default: 128 with kivi, else 0)")
    kv_outliers: int = opt(4, "exact entries per token and head for 'outlier'")
    kv_sparse_threshold: float = opt(0.5, "'sparse' drops entries below this times the token-head RMS")
    kv_sparse_capacity: float = opt(0.5, "'sparse' stores at most this fraction of head_dim per token-head")
    kv_fp8_scales: str = opt("token", "fp8 pages: token stores a dynamic scale per token and KV head; head uses "
                                      "one fixed scale per layer and KV head (vLLM's per-head scales), "
                                      "calibrated at start-up on kv_calibration_tokens tokens of "
                                      "kv_calibration_data, and stores codes alone", choices=FP8_SCALES)
    kv_calibration_tokens: int = opt(512, "tokens the start-up calibration reads (kv_fp8_scales=head, "
                                          "kv_key_wide_channels)")
    kv_calibration_data: str = opt("calibration", "text the start-up calibration reads: calibration (bundled "
                                                  "with kvserve, read by no evaluation), python-docs, wikitext2 "
                                                  "or a file path; kvserve eval refuses --data that overlaps it")
    kv_exact_sink: bool = opt(False, "kivi keys: each block keeps its first key in fp16, outside the block's "
                                     "channel ranges, so a sequence's first token (the attention sink every "
                                     "query reads) is exact and cannot stretch its block's ranges; costs "
                                     "16 / block_size bits per key value (kivi2_mix_unrope, kivi2_vq: the first key and "
                                     "value in int8, 8 / block_size bits each)")
    kv_key_wide_channels: int = opt(0, "kivi keys: this many channels per KV head (a multiple of 8; whole RoPE "
                                       "pairs) get one bit more, those with the largest E[q^2] * E[range^2], "
                                       "chosen at start-up on kv_calibration_tokens tokens; costs that many bits "
                                       "per key; pair with kv_rotate_keys=false. The *_mix formats: that many "
                                       "bits per KV head beyond 2 or 4 a channel, all of them spread over the "
                                       "channels by the same importance")
    kv_symmetric_values: bool = opt(False, "kivi values: codes symmetric about zero with a scale and no "
                                           "zero-point, 16 bits per group fewer; best with rotated values")

    def _check(self) -> None:
        self._check_names()
        try:
            check_format_options(self.kv_group_size, self.kv_outliers, self.kv_sparse_threshold,
                                 self.kv_sparse_capacity, self.kv_fp8_scales, self.kv_key_wide_channels)
        except FieldError as err:
            raise FieldError(err.field, f"KVFormatOptions.{err}") from None
        self._positive("kv_calibration_tokens")
        if self.kv_calibration_data not in TEXT_NAMES and not Path(self.kv_calibration_data).is_file():
            raise FieldError("kv_calibration_data",
                             f"KVFormatOptions.kv_calibration_data must be one of {', '.join(TEXT_NAMES)} or a "
                             f"file, got {self.kv_calibration_data!r}")
        if self.kv_residual is not None and self.kv_residual < 0:
            raise FieldError("kv_residual",
                             f"KVFormatOptions.kv_residual must be an integer >= 0, got {self.kv_residual!r}")
        self._one_of("kv_rotation", ROTATIONS)
        # Every compressed format named is built once ('auto' pages are the model's dtype: valid).
        try:
            pairs = [self.format_pair(p) for p in self.format_names(torch.float32) if p != ("fp32", "fp32")]
        except FieldError as err:
            raise FieldError(err.field, f"KVFormatOptions.{err}") from None
        except ValueError as err:  # a plan file's or a format's own error
            raise FieldError("kv_cache_dtype", f"KVFormatOptions.kv_cache_dtype: {err}") from None
        if self.kv_rotation != "none" and self.kv_rotate_keys:
            if paired := sorted({k.name for k, _ in pairs if k.reads_rope_pairs}):
                raise FieldError("kv_rotate_keys",
                                 f"KVFormatOptions.kv_rotate_keys: {', '.join(paired)} turns keys back by their RoPE "
                                 f"angle, channel i with i + head_dim/2, which kv_rotation={self.kv_rotation} would "
                                 "mix; set kv_rotate_keys=false (--no-kv-rotate-keys) to rotate values only")

    def _check_names(self) -> None:
        for name in ("kv_cache_dtype", "kv_cache_dtype_k", "kv_cache_dtype_v"):
            value = getattr(self, name)
            if name == "kv_cache_dtype" and plan_path(value) is not None:
                if self.kv_cache_dtype_k or self.kv_cache_dtype_v:
                    raise FieldError("kv_cache_dtype_k",
                                     "KVFormatOptions.kv_cache_dtype_k / kv_cache_dtype_v: a plan (kv_cache_dtype="
                                     "'plan:...') names each layer's formats; drop the role overrides")
                continue
            if value is not None and value != "auto" and value not in FORMAT_CHOICES:
                plan = ", 'plan:PATH' (a tune-kv plan)" if name == "kv_cache_dtype" else ""
                raise FieldError(name, f"KVFormatOptions.{name} must be 'auto'{plan} or one of "
                                       f"{', '.join(FORMAT_CHOICES)}, got {value!r}")

    def format_names(self, dtype: torch.dtype) -> list[tuple[str, str]]:
        """(keys, values) format names, 'auto' resolved to `dtype`: a plan's, one pair per layer, or
        one pair for every layer."""
        auto = _DTYPE_FORMAT[dtype]
        path = plan_path(self.kv_cache_dtype)
        if path is not None:
            pairs = list(KVPlan.load(path).layers)
        else:
            base = auto if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
            pairs = [(self.kv_cache_dtype_k or base, self.kv_cache_dtype_v or base)]
        return [(auto if k == "auto" else k, auto if v == "auto" else v) for k, v in pairs]

    def formats(self, dtype: torch.dtype) -> list[FormatPair] | None:
        """The (keys, values) formats of a compressed pool, as `format_names` lists them; None when
        every page holds the model's `dtype`."""
        auto = _DTYPE_FORMAT[dtype]
        pairs = self.format_names(dtype)
        if all(pair == (auto, auto) for pair in pairs):
            return None
        return [self.format_pair(pair) for pair in pairs]

    def layer_formats(self, dtype: torch.dtype, num_layers: int) -> list[FormatPair] | None:
        """`formats` for each of a model's `num_layers` layers; a plan must name exactly that many."""
        formats = self.formats(dtype)
        if formats is None:
            return None
        if plan_path(self.kv_cache_dtype) is None:
            return formats * num_layers
        if len(formats) != num_layers:
            raise FieldError("kv_cache_dtype", f"KVFormatOptions.kv_cache_dtype: the plan names {len(formats)} "
                                               f"layers, the model has {num_layers}")
        return formats

    def residual_tokens(self, dtype: torch.dtype) -> int:
        """Recent tokens kept in full precision: kv_residual, or the largest default of the formats."""
        if self.kv_residual is not None:
            return self.kv_residual
        return max(format_entry(n).default_residual for pair in self.format_names(dtype) for n in pair)

    def format_pair(self, names: tuple[str, str]) -> FormatPair:
        kwargs = {"outliers": self.kv_outliers, "sparse_threshold": self.kv_sparse_threshold,
                  "sparse_capacity": self.kv_sparse_capacity, "fp8_scales": self.kv_fp8_scales,
                  "exact_sink": self.kv_exact_sink, "key_wide_channels": self.kv_key_wide_channels,
                  "symmetric_values": self.kv_symmetric_values}
        formats = []
        for name, role in zip(names, ("k", "v")):
            field = f"kv_group_size_{role}"
            own = getattr(self, field)
            try:
                formats.append(make_format(name, role, group_size=self.kv_group_size if own is None else own, **kwargs))
            except FieldError as err:  # name the field the bad group size came from
                if own is None:
                    raise
                raise FieldError(field, str(err).replace("kv_group_size", field, 1)) from None
        return formats[0], formats[1]
