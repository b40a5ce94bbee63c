"""The formats kvserve ships, registered in the order their names are listed."""
from __future__ import annotations

import torch

from kvserve.cache.formats.absmax import AbsMaxFormat, HeadScaleFormat
from kvserve.cache.formats.base import KVFormat
from kvserve.cache.formats.fitted import FittedFormat
from kvserve.cache.formats.grouped import GroupFormat
from kvserve.cache.formats.kivi import ChannelFormat, MixedChannelFormat
from kvserve.cache.formats.options import FormatOptions, Role
from kvserve.cache.formats.plain import PlainFormat
from kvserve.cache.formats.registry import FormatFactory, register
from kvserve.cache.formats.sparse import OutlierFormat, SparseFormat
from kvserve.cache.formats.unroped import SinkValueFormat, UnropedChannelFormat
from kvserve.cache.formats.vector import VectorFormat, load_codebook

# KIVI's full-precision window (its paper's R = 128): its keys are encoded a block at a time
# anyway, and the recent tokens, which draw the most attention, stay exact a while longer.
KIVI_RESIDUAL = 128


def _plain(name: str, dtype: torch.dtype) -> FormatFactory:
    return lambda role, options: PlainFormat(name, dtype)


def _fp8(name: str, code_dtype: torch.dtype) -> FormatFactory:
    def make(role: Role, options: FormatOptions) -> KVFormat:
        if options.fp8_scales == "head":
            return HeadScaleFormat(name, code_dtype)
        return AbsMaxFormat(name, code_dtype)
    return make


def _kivi(name: str, bits: int, keys: type[ChannelFormat] | type[MixedChannelFormat] = ChannelFormat,
          value_sinks: bool = False, vector_values: bool = False) -> FormatFactory:
    """`value_sinks`: with kv_exact_sink the values keep each block's first value too (SinkValueFormat);
    `vector_values`: values in 4-channel pieces against the shipped codebook (VectorFormat), not `bits`-bit
    groups."""
    def make(role: Role, options: FormatOptions) -> KVFormat:
        if role == "k":
            return keys(name, bits, options.exact_sink, options.key_wide_channels)
        values: GroupFormat | VectorFormat = (
            VectorFormat(name, load_codebook()) if vector_values
            else GroupFormat(name, bits, options.group_size, options.symmetric_values))
        return SinkValueFormat(values) if value_sinks and options.exact_sink else values
    return make


register("bf16", _plain("bf16", torch.bfloat16))
register("fp16", _plain("fp16", torch.float16))
register("fp32", _plain("fp32", torch.float32))
register("fp8_e4m3", _fp8("fp8_e4m3", torch.float8_e4m3fn), default_in=("eval", "tune"))
register("fp8_e5m2", _fp8("fp8_e5m2", torch.float8_e5m2), default_in=("eval",))
# Fitted scales, keys after a calibrated offset (fitted.py): fp8 at fp8_e4m3's 8.25 bits, its
# error where queries do not look.
register("fp8_e4m3_fit", lambda role, options: FittedFormat("fp8_e4m3_fit", torch.float8_e4m3fn, calibrate=role == "k"))
# int8 keeps a scale per token whatever kv_fp8_scales says: its per-head scales are not built.
register("int8", lambda role, options: AbsMaxFormat("int8", torch.int8), default_in=("eval", "tune", "bench"))
# The same on int8 codes, keys also equalised per channel, at int8's 8.25 bits: under plain int8
# Gemma 3's keys lose 5x SmolLM2's, a few large channels setting a coarse step for the rest (fitted.py).
register("int8_fit", lambda role, options: FittedFormat("int8_fit", torch.int8, calibrate=role == "k",
                                                        equalise=True))
register("int4", lambda role, options: GroupFormat("int4", 4, options.group_size),
         default_in=("eval", "tune", "bench"))
register("kivi2", _kivi("kivi2", 2), default_residual=KIVI_RESIDUAL, default_in=("eval", "tune", "bench"))
register("kivi4", _kivi("kivi4", 4), default_residual=KIVI_RESIDUAL, default_in=("eval", "tune"))
# kivi's price (its codes, kv_key_wide_channels more bits per head), the key bits spread over
# channels by calibrated importance (0 or 2 up to twice kivi's bits a channel): Gemma 3's keys lose
# most of the 2.5- and 4.5-bit layouts' error, in few channels (kivi.py, issue 42).
register("kivi2_mix", _kivi("kivi2_mix", 2, MixedChannelFormat), default_residual=KIVI_RESIDUAL)
register("kivi4_mix", _kivi("kivi4_mix", 4, MixedChannelFormat), default_residual=KIVI_RESIDUAL)
# kivi2_mix on keys turned back by their offset in the block, and with kv_exact_sink int8 sinks for keys
# and values (unroped.py): at 2.5 bits a value a third less KL than kivi2_mix on SmolLM2 (issue 42).
register("kivi2_mix_unrope", _kivi("kivi2_mix_unrope", 2, UnropedChannelFormat, value_sinks=True),
         default_residual=KIVI_RESIDUAL)
# kivi2_mix_unrope's keys, values as 9-bit codes of 4-channel pieces (vector.py: 2 bytes a head and token
# more than 2-bit groups of 64, paid for with 16 fewer wide key channels, 14-26% off SmolLM2's KL at 2.5 bits).
register("kivi2_vq", _kivi("kivi2_vq", 2, UnropedChannelFormat, value_sinks=True, vector_values=True),
         default_residual=KIVI_RESIDUAL)
register("outlier", lambda role, options: OutlierFormat(options.group_size, options.outliers), default_in=("eval",))
register("sparse", lambda role, options: SparseFormat(options.sparse_threshold, options.sparse_capacity),
         default_in=("eval",))
