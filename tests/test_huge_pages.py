"""Weights and KV pools in transparent huge pages (kvserve/huge_pages.py)."""
from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch
from torch import nn

from kvserve import SamplingParams
from kvserve.huge_pages import HUGE_PAGE, huge_page_bytes, huge_page_zeros, move_to_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or not THP.exists() or "[never]" in THP.read_text(),
                               reason="this system has no transparent huge pages to ask for")


def thp_eligible(t: torch.Tensor) -> bool:
    """Whether the kernel lists the mapping that holds t's first byte as eligible for huge pages
    (its `THPeligible` line in /proc/self/smaps: set by madvise(MADV_HUGEPAGE) under the `madvise`
    mode, for every anonymous mapping under `always`)."""
    address, inside = t.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds address {address:#x}")


@needs_thp
def test_zeros_share_one_region_start_on_a_huge_page_and_are_eligible() -> None:
    a, b, c = huge_page_zeros([((300, 16, 3, 64), torch.bfloat16), ((7,), torch.float16), ((5, 3), torch.uint8)],
                              torch.device("cpu"))
    assert (a.shape, a.dtype, b.shape, b.dtype, c.shape, c.dtype) == \
        ((300, 16, 3, 64), torch.bfloat16, (7,), torch.float16, (5, 3), torch.uint8)
    assert a.data_ptr() % HUGE_PAGE == 0 and all(thp_eligible(t) for t in (a, b, c))
    # One region, each on a cache line right after the one before: a pool's small tensors do not
    # each hold a huge page of their own.
    assert b.data_ptr() == a.data_ptr() + a.nbytes and c.data_ptr() == b.data_ptr() + 64
    assert not a.any() and not b.any() and not c.any()
    a[7] = 2.0
    b[:] = 3.0
    assert a.sum().item() == 2.0 * 16 * 3 * 64 and b.sum().item() == 21.0 and not c.any()


def rss_kib() -> int:
    return int(next(line for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("VmRSS:")).split()[1])


@needs_thp
def test_zeros_are_resident_from_the_start_and_cost_their_size() -> None:
    """Written when made, as torch.zeros is (a budget past the free memory fails then, not in a
    later step), and in one region: 120 tensors of 33 KB cost about their 4 MB, not a huge page each."""
    before = rss_kib()
    tensors = huge_page_zeros([((33_000,), torch.uint8)] * 120, torch.device("cpu"))
    grown = rss_kib() - before
    assert 120 * 33_000 / 1024 <= grown <= 120 * 33_000 / 1024 + 2 * HUGE_PAGE / 1024 + 1024
    del tensors


def test_plain_torch_memory_where_huge_pages_cannot_be_asked_for() -> None:
    assert huge_page_bytes(0) is None
    [meta] = huge_page_zeros([((4, 8), torch.float16)], torch.device("meta"))  # not the CPU: torch.zeros
    assert meta.device.type == "meta" and meta.shape == (4, 8)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.proj = nn.Linear(32, 48)
        self.head = nn.Linear(32, 50, bias=False)
        self.head.weight = self.embed.weight  # tied, as SmolLM2's LM head is
        # a second tensor object on the same storage, as SmallBatchLinear's kernel-layout buffer is
        self.register_buffer("head_rows", self.embed.weight.detach(), persistent=False)
        self.register_buffer("table", torch.arange(96, dtype=torch.float32).view(3, 32))
        self.register_buffer("rows", self.table[1:], persistent=False)  # a view of another buffer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.table.sum(0) + self.rows.sum(0)
        return self.head(h) + self.proj(h).sum(-1, keepdim=True)


@needs_thp
def test_move_keeps_values_sharing_and_kinds() -> None:
    torch.manual_seed(0)
    model = Tied()
    ids = torch.tensor([[1, 7, 49, 3]])
    before = model(ids)
    expected_bytes = sum(-(-t.nbytes // 64) * 64 for t in (model.embed.weight, model.proj.weight, model.proj.bias))
    assert move_to_huge_pages(model) == expected_bytes
    assert torch.equal(model(ids), before)
    assert model.head.weight is model.embed.weight and isinstance(model.embed.weight, nn.Parameter)
    assert model.head_rows.data_ptr() == model.embed.weight.data_ptr() and not isinstance(model.head_rows, nn.Parameter)
    assert model.proj.weight.requires_grad
    moved = [model.embed.weight, model.proj.weight, model.proj.bias]
    base = min(t.data_ptr() for t in moved)
    assert base % HUGE_PAGE == 0 and all(t.data_ptr() % 64 == 0 and thp_eligible(t) for t in moved)
    assert max(t.data_ptr() + t.nbytes for t in moved) - base <= expected_bytes  # one region
    # A buffer with a view of it on the model stays, with its view: writes to one still show in the other.
    assert not base <= model.table.data_ptr() < base + expected_bytes
    assert model.rows.data_ptr() == model.table[1:].data_ptr()


@needs_thp
def test_engine_weights_and_pages_are_in_huge_pages(tiny_llm) -> None:  # type: ignore[no-untyped-def]
    llm = tiny_llm(dtype="bfloat16")
    runner = llm.engine.runner
    assert all(thp_eligible(p) for p in runner.model.parameters())
    assert all(thp_eligible(t) for t in runner.pool.block_tensors)
    out = llm.generate([[5, 9, 17, 3, 60]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4  # the pages written and read, the weights read


def test_the_thp_mode_is_the_bracketed_word(tmp_path: Path) -> None:
    from kvserve.huge_pages import huge_page_mib, thp_mode

    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    assert thp_mode(mode) == "madvise"
    assert thp_mode(tmp_path / "missing") is None
    rollup = tmp_path / "smaps_rollup"
    rollup.write_text("Rss:  900 kB\nAnonHugePages:    4096 kB\n")
    assert huge_page_mib(rollup) == 4.0 and huge_page_mib(tmp_path / "missing") is None
