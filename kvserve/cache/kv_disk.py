"""A disk tier of full prefix blocks that survives restarts (`kv_disk_dir`): after a deploy, a
system prompt or document another run computed is read back instead of prefilled again
(llama.cpp's slot files and LMCache's disk backend are the models).

Blocks are written as they join the prefix cache and read on a local prefix miss, one file per
block in a directory per namespace (block_tier.py: model fingerprint, formats, block size,
rotation, layout version, rank), named by the block's chain hash and sealed: a flipped byte, a
truncated file or one copied from another namespace fails its check, is counted
(`stats.corrupt`), deleted and read as a miss, never into a page. A write goes to a temporary
file renamed into place, so a crash leaves a whole file or none (leftovers are swept at start).
The directory holds at most `capacity` bytes, the least recently used files going first; one
engine at a time owns a namespace's directory (an exclusive lock, refused naming the field), so
two servers cannot interleave its bookkeeping. A write that fails (a full disk) is counted in
`stats.errors`, logged, and the block is computed next time instead.

Its KV events (medium `DISK`, kv_events.py) are exact, since the tier alone changes its
directory: at start a `BlockStored` names every block found there (after the engine's
`AllBlocksCleared`, a router learns what survived the restart), then one follows each file
written, and a `BlockRemoved` each file deleted (the size bound's eviction, a file that failed its
check or could not be read). Files are not removed when the tier closes: the next engine's start
announces them again.
"""
from __future__ import annotations

import fcntl
import logging
import os
from collections import OrderedDict
from pathlib import Path

from kvserve.cache.block_tier import HEADER, BlockTier
from kvserve.cache.kv_events import TierEvents
from kvserve.validate import FieldError

logger = logging.getLogger(__name__)
_SUFFIX = ".kvb"


class DiskKVTier(BlockTier):
    def __init__(self, root: str | Path, namespace: str, block_bytes: int, capacity: int,
                 secret: str | None = None, events: TierEvents | None = None) -> None:
        # No events until the start's sweep is done: it removes files nobody was told of.
        super().__init__(namespace, block_bytes, secret)
        self.dir = Path(root) / self.namespace_digest
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.dir / ".lock", "a+")
        except OSError as err:
            raise FieldError("kv_disk_dir", f"kv_disk_dir: cannot use {root!r} ({err})") from err
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise FieldError("kv_disk_dir", f"kv_disk_dir: {self.dir} is in use by another engine of the same "
                                            f"model and formats; give each engine a directory of its own") from None
        if capacity < HEADER + block_bytes:
            self._lock.close()
            raise FieldError("kv_disk_memory", f"kv_disk_memory ({capacity} bytes) holds no block "
                                               f"({HEADER + block_bytes} bytes each for this model and format)")
        self.capacity = capacity
        # Leftovers of a crash, and block files no chain hash names (never read: only taking room).
        unnamed = [p for p in self.dir.glob("*" + _SUFFIX) if not _names_a_block(p.name)]
        for leftover in [*self.dir.glob("*.tmp"), *unnamed]:
            leftover.unlink(missing_ok=True)
        files = sorted(self.dir.glob("*" + _SUFFIX), key=lambda p: p.stat().st_mtime)
        self._files: OrderedDict[str, int] = OrderedDict((p.name, p.stat().st_size) for p in files)  # LRU first
        self._bytes = sum(self._files.values())
        self._make_room(0)
        self.events = events
        self._stored([_hash_of(name) for name in self._files])

    @property
    def available(self) -> bool:
        """Until `close`: a closed tier's directory may belong to another engine already."""
        return not self._lock.closed

    @property
    def bytes_held(self) -> int:
        return self._bytes

    def key(self, block_hash: bytes) -> bytes:
        return self.namespace_digest.encode() + b"/" + block_hash.hex().encode()

    def fetch(self, hashes: list[bytes]) -> list[bytes]:
        """Payloads of the longest run of `hashes`, from the first, held intact."""
        if not self.available:
            return []
        self.stats.lookups += len(hashes)
        out = []
        for block_hash in hashes:
            name = block_hash.hex() + _SUFFIX
            if name not in self._files:
                break
            path = self.dir / name
            try:
                payload = self.unpack(block_hash, path.read_bytes())
            except OSError:
                payload = None
                self.stats.errors += 1
            if payload is None:
                self._drop(name)
                break
            os.utime(path)  # its use, for the LRU order of the next start
            self._files.move_to_end(name)
            out.append(payload)
        self.stats.hits += len(out)
        self.stats.bytes_read += sum(map(len, out))
        return out

    def store(self, blocks: list[tuple[bytes, bytes]]) -> None:
        """(chain hash, payload) pairs; a block already held is left as it is (same name, same content)."""
        if not self.available:
            return
        for block_hash, payload in blocks:
            name = block_hash.hex() + _SUFFIX
            if name in self._files:
                continue
            value = self.pack(block_hash, payload)
            self._make_room(len(value))
            tmp = self.dir / f"{name}.{os.getpid()}.tmp"
            try:
                with open(tmp, "wb") as f:
                    f.write(value)
                os.replace(tmp, self.dir / name)
            except OSError as err:
                tmp.unlink(missing_ok=True)
                self.stats.errors += 1
                logger.warning("kvserve: the disk KV tier could not write %s (%s); its blocks are computed instead",
                               self.dir, err)
                return
            self._files[name] = len(value)
            self._bytes += len(value)
            self.stats.stored += 1
            self.stats.bytes_written += len(payload)
            self._stored([block_hash])  # one by one: a later block of the call may evict an earlier

    def close(self) -> None:
        """Gives the directory up (its lock) for the next engine."""
        self._lock.close()

    def _make_room(self, size: int) -> None:
        while self._files and self._bytes + size > self.capacity:
            self._drop(next(iter(self._files)))

    def _drop(self, name: str) -> None:
        self._bytes -= self._files.pop(name)
        (self.dir / name).unlink(missing_ok=True)
        self._removed([_hash_of(name)])


def _hash_of(name: str) -> bytes:
    """The chain hash a block file is named by (ValueError for a name no block is written under)."""
    return bytes.fromhex(name.removesuffix(_SUFFIX))


def _names_a_block(name: str) -> bool:
    try:
        _hash_of(name)
    except ValueError:
        return False
    return True
