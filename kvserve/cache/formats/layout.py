"""What a format's pages look like to a kernel: one typed declaration per format (`PageLayout`).

Backends, the pool and the configuration read a format's layout, never its name, so a new format
is usable wherever its layout says it is: one with no `kind` is decoded by the torch backend
through the format's own `decode`; one whose kind a kernel knows is read in place.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import torch


class PageKind(IntEnum):
    """How a kernel reads a page. The numbers are the C++ and Triton kernels' own: never renumber.

    DENSE: values as stored. ABSMAX: int8 / fp8 codes times one scale per token and head.
    GROUPED: packed `bits`-bit codes with a scale (and, unless symmetric, a zero-point) per
    `group_size` channels of each token. CHANNEL: packed codes with a scale and zero-point per
    block, head and channel, encoded a block at a time (KIVI keys). HEAD_ABSMAX: fp8 codes times
    one fixed fp32 scale per KV head, held by the format (`head_scale`), not the pages."""
    DENSE = 0
    ABSMAX = 1
    GROUPED = 2
    CHANNEL = 3
    HEAD_ABSMAX = 4


@dataclass(frozen=True)
class PageLayout:
    """A format's pages as a kernel reads them. `kind` None: no kernel decodes them (the torch
    backend does, through the format). Equal layouts are pages of the same shape read the same
    way; the calibrated tables a format holds (`head_scale`, `wide_channels`) are its values, not
    its layout, so they take no part in equality."""
    kind: PageKind | None
    per_token: bool = True  # False: encoded a whole block at a time, through full-precision staging
    bits: int = 0           # width of packed codes (GROUPED, CHANNEL and the like); 0: whole-dtype codes
    group_size: int = 0     # channels per scale (and zero-point) of a token; 0: not grouped
    symmetric: bool = False  # midrise codes with a scale and no zero-point
    exact_sink: bool = False  # each block's first token kept in fp16 (field "sink")
    wide: int = 0           # channels per KV head with one bit more (field "wide", a bit plane)
    # ABSMAX codes whose scales a search chose (`FitTables`, fitted.py): the absmax encoder does not
    # write them. Fitted keys decode with a per-channel offset added, which a kernel leaves out: it
    # adds the same q.offset to every logit of a query, and softmax cancels it (exact where logits
    # are not soft-capped, as on the cpu backend).
    fitted: bool = False
    head_scale: torch.Tensor | None = field(default=None, compare=False, repr=False)  # [kv_heads] fp32
    wide_channels: torch.Tensor | None = field(default=None, compare=False, repr=False)  # [kv_heads, wide]
    fit: FitTables | None = field(default=None, compare=False, repr=False)  # with `fitted`


@dataclass(frozen=True)
class FitTables:
    """What an encoder of fitted codes reads (fitted.py): each token less `offset`, divided by
    `spread`, takes of the scales its largest |x| / `targets` the one of least e^T `weight` e.
    `spread` is also what a kernel multiplies the query by (keys decode as codes x scale x spread
    per channel: q.(c * s) = (q * s).c). None: no offset, no spread, plain squared error."""
    targets: torch.Tensor                # [candidates] fp32
    offset: torch.Tensor | None = None   # [kv_heads, D] fp32
    spread: torch.Tensor | None = None   # [kv_heads, D] fp32
    weight: torch.Tensor | None = None   # [kv_heads, D, D] fp32

    def kernel_args(self, none: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """offset, spread and weight (`none` where absent), then targets: encode_fitted_write's."""
        return (*(none if t is None else t for t in (self.offset, self.spread, self.weight)), self.targets)
