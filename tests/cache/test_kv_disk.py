"""The disk tier of prefix blocks against worked cases: a round trip, every kind of bad file
counted and skipped (flipped, truncated, foreign), a full disk, the size bound, one engine per
directory, and KV events that follow the directory's files."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from kvserve.cache.blocks import block_hash
from kvserve.cache.kv_disk import DiskKVTier
from kvserve.cache.kv_events import DISK, BlockRemoved, BlockStored, TierEvents
from kvserve.validate import FieldError

HASHES = [block_hash(None, (i,)) for i in range(6)]
PAYLOADS = [bytes([i]) * 100 for i in range(6)]


def tier(root: Path, namespace: str = "model-a", capacity: int = 10_000) -> DiskKVTier:
    return DiskKVTier(root, namespace, 100, capacity)


def file_of(t: DiskKVTier, i: int) -> Path:
    return t.dir / (HASHES[i].hex() + ".kvb")


def test_blocks_survive_the_tier_and_a_run_stops_at_the_first_missing(tmp_path: Path) -> None:
    t = tier(tmp_path)
    t.store(list(zip(HASHES[:3], PAYLOADS[:3])))
    t.close()
    again = tier(tmp_path)  # a restart: a new tier on the same directory
    assert again.fetch(HASHES[:3]) == PAYLOADS[:3]
    assert again.fetch([HASHES[0], HASHES[4], HASHES[1]]) == PAYLOADS[:1]
    assert tier(tmp_path / "other", "model-a").fetch(HASHES[:1]) == []  # another directory holds nothing
    assert (again.stats.hits, again.stats.bytes_read) == (4, 400)


@pytest.mark.parametrize("damage", ["flipped", "truncated", "foreign"])
def test_a_bad_file_is_counted_skipped_and_deleted(tmp_path: Path, damage: str) -> None:
    t = tier(tmp_path)
    t.store(list(zip(HASHES[:2], PAYLOADS[:2])))
    path = file_of(t, 1)
    data = bytearray(path.read_bytes())
    if damage == "flipped":
        data[-7] ^= 0x10
    elif damage == "truncated":
        data = data[:-30]
    else:  # the same block written by an engine of another model or format, copied in
        other = tier(tmp_path, "model-b")
        data = bytearray(other.pack(HASHES[1], PAYLOADS[1]))
    path.write_bytes(bytes(data))
    t.close()
    again = tier(tmp_path)
    assert again.fetch(HASHES[:2]) == PAYLOADS[:1]
    assert again.stats.corrupt == 1 and not path.exists()


def test_a_full_disk_is_counted_and_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = tier(tmp_path)

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    t.store([(HASHES[0], PAYLOADS[0])])
    monkeypatch.undo()
    assert t.stats.errors == 1 and t.stats.stored == 0
    assert t.fetch(HASHES[:1]) == [] and not list(t.dir.glob("*.kvb")) and not list(t.dir.glob("*.tmp"))


def test_the_size_bound_holds_least_recently_used_first(tmp_path: Path) -> None:
    size = len(tier(tmp_path / "probe").pack(HASHES[0], PAYLOADS[0]))
    t = tier(tmp_path, capacity=3 * size)
    t.store(list(zip(HASHES[:3], PAYLOADS[:3])))
    assert t.fetch(HASHES[:1]) == PAYLOADS[:1]  # block 0 used: block 1 is now the least recent
    t.store(list(zip(HASHES[3:5], PAYLOADS[3:5])))
    held = sorted(p.name for p in t.dir.glob("*.kvb"))
    assert held == sorted(file_of(t, i).name for i in (0, 3, 4))
    assert t.bytes_held == 3 * size == sum(p.stat().st_size for p in t.dir.glob("*.kvb"))


def test_a_bound_below_one_block_is_refused_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(FieldError, match="kv_disk_memory") as err:
        tier(tmp_path, capacity=120)
    assert err.value.field == "kv_disk_memory"
    tier(tmp_path).close()  # and the directory is free again


def test_one_engine_per_directory(tmp_path: Path) -> None:
    t = tier(tmp_path)
    with pytest.raises(FieldError, match="kv_disk_dir") as err:
        tier(tmp_path)
    assert err.value.field == "kv_disk_dir"
    tier(tmp_path, "model-b").close()  # another namespace has a directory of its own
    t.close()
    tier(tmp_path).close()


def test_a_closed_tier_neither_reads_nor_writes(tmp_path: Path) -> None:
    t = tier(tmp_path)
    t.store([(HASHES[0], PAYLOADS[0])])
    t.close()
    t.store([(HASHES[1], PAYLOADS[1])])
    assert t.fetch(HASHES[:1]) == [] and not file_of(t, 1).exists()


def held_files(t: DiskKVTier) -> set[bytes]:
    return {bytes.fromhex(p.name.removesuffix(".kvb")) for p in t.dir.glob("*.kvb")}


def replay(events: TierEvents, held: set[bytes]) -> set[bytes]:
    """Applies the events taken from `events` to `held` as a consumer would; returns it."""
    for event in events.take():
        assert event.medium == DISK
        if isinstance(event, BlockStored):
            assert (event.parent_block_hash, event.token_ids, event.block_size) == (None, [], 16)
            held.update(event.block_hashes)
        else:
            assert isinstance(event, BlockRemoved) and set(event.block_hashes) <= held, "removed, never stored"
            held.difference_update(event.block_hashes)
    return held


def test_events_follow_the_files_through_writes_evictions_skips_and_a_restart(tmp_path: Path) -> None:
    size = len(tier(tmp_path / "probe").pack(HASHES[0], PAYLOADS[0]))
    events = TierEvents(DISK, 16)
    t = DiskKVTier(tmp_path, "model-a", 100, 3 * size, events=events)
    held: set[bytes] = set()
    assert replay(events, held) == set()  # an empty directory announces nothing
    t.store(list(zip(HASHES[:3], PAYLOADS[:3])))
    assert replay(events, held) == held_files(t) == set(HASHES[:3])
    t.store(list(zip(HASHES[3:5], PAYLOADS[3:5])))  # the size bound evicts blocks 0 and 1
    assert replay(events, held) == held_files(t) == {HASHES[2], HASHES[3], HASHES[4]}
    data = bytearray(file_of(t, 3).read_bytes())
    data[-1] ^= 1
    file_of(t, 3).write_bytes(bytes(data))
    assert t.fetch(HASHES[3:4]) == [] and t.stats.corrupt == 1  # skipped and deleted: removed
    assert replay(events, held) == held_files(t) == {HASHES[2], HASHES[4]}
    t.store([(HASHES[1], PAYLOADS[1])])
    t.close()
    assert replay(events, held) == held_files(t) == {HASHES[1], HASHES[2], HASHES[4]}
    (t.dir / "not-a-hash.kvb").write_bytes(b"junk")  # a file no block is named by: swept, never announced
    restarted = TierEvents(DISK, 16)
    again = DiskKVTier(tmp_path, "model-a", 100, 2 * size, events=restarted)  # a smaller bound: one file goes first
    found = restarted.take()
    assert len(found) == 1 and isinstance(found[0], BlockStored)  # the start's sweep says nothing of what it drops
    assert set(found[0].block_hashes) == held_files(again) and len(held_files(again)) == 2
    again.close()
