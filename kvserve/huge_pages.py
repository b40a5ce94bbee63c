"""CPU memory that the engine streams every step, in transparent huge pages.

A decode step reads every weight once (about 270 MB for SmolLM2 in bf16) and the pages of every
running sequence. In 4 KiB pages the TLB misses every 4 KiB and the hardware prefetchers stop at
each page's end; in 2 MiB pages a plain read of SmolLM2's linear weights on 2 threads ran at 36-40
GB/s where 4 KiB pages gave 28 (AMD Zen 4, BENCHMARKS.md). Linux's usual THP mode is `madvise`:
memory gets huge pages only where a program asks, and torch's allocator does not ask (unless
THP_MEM_ALLOC_ENABLE is set before its first allocation, and then for every tensor of 2 MiB and
more, and for none smaller: most of a small model's weight matrices are under 2 MiB). So the
weights move into one region that asks (`move_to_huge_pages`), and the KV pools are allocated in
such regions (`huge_page_zeros`).

A region is an anonymous private mapping, zero until written and resident only where touched; a
tensor made from it keeps it mapped for as long as the tensor lives. Where the system has no
MADV_HUGEPAGE (not Linux, or THP compiled out) the same calls return ordinary torch memory.
"""
from __future__ import annotations

import math
import mmap

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor of an arena starts on a cache line


def huge_page_bytes(nbytes: int) -> torch.Tensor | None:
    """A uint8 CPU tensor of `nbytes` zero bytes starting on a 2 MiB boundary, in a mapping asked
    to be backed by huge pages; None where the system cannot be asked."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes == 0:
        return None
    # Whole huge pages from an aligned start: a page that would cross the mapping's end stays 4 KiB.
    region = mmap.mmap(-1, -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: a touched page stays 4 KiB
    except OSError:  # a kernel without THP
        region.close()
        return None
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype, device=device); on the CPU in huge pages where the system
    has them."""
    region = None
    if device.type == "cpu":
        region = huge_page_bytes(math.prod(shape) * torch.empty(0, dtype=dtype).element_size())
    return torch.zeros(shape, dtype=dtype, device=device) if region is None else region.view(dtype).view(shape)


def move_to_huge_pages(model: nn.Module) -> int:
    """Moves `model`'s CPU parameters and buffers into one huge-page region, in place (each keeps
    its values, shape, dtype and kind; tensors that alias one storage, as a tied LM head's
    weight and its embedding do, stay aliases). A storage moves only if every tensor of the
    model on it is the whole of it: a view and its base keep sharing where they were. Returns the
    bytes moved (0 where the system has no huge pages to ask for)."""
    holders = [(module._parameters, name) for module in model.modules() for name in module._parameters] + \
              [(module._buffers, name) for module in model.modules() for name in module._buffers]
    # Plain CPU tensors only: oneDNN's prepacked weights (PackedLinear) have no storage to move.
    tensors = {id(t): t for table, name in holders
               if (t := table[name]) is not None and t.device.type == "cpu" and t.layout == torch.strided
               and not t.is_mkldnn}
    storages: dict[int, list[torch.Tensor]] = {}
    for t in tensors.values():
        storages.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    groups = [group for group in storages.values()
              if all(_whole(t) and t.shape == group[0].shape and t.dtype == group[0].dtype for t in group)]
    offsets, end = [], 0
    for group in groups:
        offsets.append(end)
        end += -(-group[0].nbytes // ALIGN) * ALIGN
    region = huge_page_bytes(end)
    if region is None:
        return 0
    moved: dict[int, torch.Tensor] = {}
    for group, offset in zip(groups, offsets):
        first = group[0]
        view = region[offset:offset + first.nbytes].view(first.dtype).view(first.shape)
        view.copy_(first.detach())
        for t in group:
            moved[id(t)] = nn.Parameter(view, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else view
    for table, name in holders:
        t = table[name]
        if t is not None and id(t) in moved:
            table[name] = moved[id(t)]
    return end


def _whole(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.nbytes > 0 and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
