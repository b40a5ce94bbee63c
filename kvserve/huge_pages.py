"""CPU memory that the engine streams every step, in transparent huge pages.

A decode step reads every weight once (about 270 MB for SmolLM2 in bf16) and the pages of every
running sequence. In 4 KiB pages the TLB misses every 4 KiB and the hardware prefetchers stop at
each page's end; in 2 MiB pages a plain read of SmolLM2's linear weights on 2 threads ran at 36-40
GB/s where 4 KiB pages gave 28 (AMD Zen 4, BENCHMARKS.md). Linux's usual THP mode is `madvise`:
memory gets huge pages only where a program asks, and torch's allocator does not ask (unless
THP_MEM_ALLOC_ENABLE is set before its first allocation, and then for every tensor of 2 MiB and
more, and for none smaller: most of a small model's weight matrices are under 2 MiB). So the
weights move into one region that asks (`move_to_huge_pages`), and each KV pool is allocated in
one such region (`huge_page_zeros`).

A region is an anonymous private mapping, zero until written and resident only where touched
(the pools' regions are written at once, the weights' as they are copied in); a tensor made from it
keeps it mapped for as long as the tensor lives. Where the system has no MADV_HUGEPAGE (not Linux,
or THP compiled out) the same calls return ordinary torch memory.
"""
from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor of an arena starts on a cache line
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
Holder = tuple[dict[str, torch.Tensor | None], str]  # a module's parameter or buffer table, and a name in it


def thp_mode(path: Path = THP_MODE) -> str | None:
    """The system's transparent huge page mode (`always`, `madvise` or `never`: the bracketed
    word of `path`), or None where there is no such file (not Linux, THP compiled out)."""
    try:
        words = path.read_text().split()
    except OSError:
        return None
    return next((w[1:-1] for w in words if w.startswith("[")), None)


def huge_page_mib(smaps: Path = Path("/proc/self/smaps_rollup")) -> float | None:
    """This process's memory in transparent huge pages (AnonHugePages), or None where unknown."""
    try:
        line = next(line for line in smaps.read_text().splitlines() if line.startswith("AnonHugePages:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) / 1024


def _offsets(nbytes: list[int]) -> list[int]:
    """Where each of tensors of `nbytes` starts in one region, each on a cache line; last: the
    region's size."""
    offsets = [0]
    for n in nbytes:
        offsets.append(offsets[-1] + -(-n // ALIGN) * ALIGN)
    return offsets


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


def huge_page_zeros(specs: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> list[torch.Tensor]:
    """torch.zeros(shape, dtype=dtype, device=device) for each (shape, dtype) of `specs`; on the CPU
    all in one huge-page region (each tensor on a cache line) where the system has them, its
    memory written now. One region, not one each: a region's last huge page is resident whole,
    and a pool of 120 small tensors in regions of their own took 4x its budget. Written now, as
    torch.zeros is: a budget past the free memory fails at start-up, not in the step that first
    touches it."""
    nbytes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    offsets = _offsets(nbytes)
    region = huge_page_bytes(offsets[-1]) if device.type == "cpu" else None
    if region is None:
        return [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in specs]
    region.zero_()
    return [region[at:at + n].view(dtype).view(shape) for (shape, dtype), at, n in zip(specs, offsets, nbytes)]


def move_to_huge_pages(model: nn.Module) -> int:
    """Moves `model`'s CPU parameters and buffers into one huge-page region, in place (each keeps
    its values, shape, dtype and kind; tensors that alias one storage, as a tied LM head's
    weight and its embedding do, stay aliases). A storage moves only if every tensor of the
    model on it is the whole of it: a view and its base keep sharing where they were. One storage
    at a time, each freed as its copy takes its place, so the weights are never all held twice.
    Returns the bytes moved (0 where the system has no huge pages to ask for).

    A moved tensor is a view of the region: pickling one (torch.save) writes the whole region;
    clone it first."""
    holders: list[Holder] = [(table, name) for module in model.modules()
                             for table in (module._parameters, module._buffers) for name in table]
    # Plain CPU tensors only: oneDNN's prepacked weights (PackedLinear) have no storage to move.
    by_storage: dict[int, list[Holder]] = {}
    for table, name in holders:
        t = table[name]
        if t is not None and t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn \
                and not t.is_quantized:
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append((table, name))
    groups = [group for group in by_storage.values()
              if all(_whole(table[name], group[0][0][group[0][1]]) for table, name in group)]
    nbytes = [group[0][0][group[0][1]].nbytes for group in groups]
    del by_storage
    offsets = _offsets(nbytes)
    region = huge_page_bytes(offsets[-1])
    if region is None:
        return 0
    for group, at in zip(groups, offsets):
        first = group[0][0][group[0][1]]
        view = region[at:at + first.nbytes].view(first.dtype).view(first.shape)
        view.copy_(first.detach())
        new: dict[int, torch.Tensor] = {}  # a tensor object several modules hold stays one object
        for table, name in group:
            old = table[name]
            if id(old) not in new:
                new[id(old)] = nn.Parameter(view, requires_grad=old.requires_grad) \
                    if isinstance(old, nn.Parameter) else view
            table[name] = new[id(old)]
        del first, old, new
    return offsets[-1]


def _whole(t: torch.Tensor, first: torch.Tensor) -> bool:
    """Whether `t` is all of its storage, with the shape and dtype of the group's first tensor."""
    return t.is_contiguous() and t.nbytes > 0 and t.storage_offset() == 0 and \
        t.untyped_storage().nbytes() == t.nbytes and t.shape == first.shape and t.dtype == first.dtype
