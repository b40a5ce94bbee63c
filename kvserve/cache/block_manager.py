"""Gives each sequence a block table; shares blocks by reference count and caches full blocks.

Free blocks wait in one queue, in eviction order. A block that held nothing worth keeping goes
to the front, to be reused first; a full block whose last user finished keeps its contents and
its prefix hash and goes to the back, so cached blocks are evicted least recently used first
(among blocks freed together, the deepest first).

Every method that decides a block move returns it and keeps nothing for later: `allocate` the
copy-on-write copies, `allocate_prompt` a `PromptGrant` (with the remote tier's loads),
`offload_coldest` the (device, host) pair, `compact` a `Compaction`; the caller sends them to the
runner in a `BlockOps`.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvserve.cache.compaction import Compaction
from kvserve.cache.kv_remote import RemoteKVTier


@dataclass(frozen=True)
class BlockUsage:
    total: int
    used: int               # blocks with at least one owner
    free: int               # unowned blocks holding nothing reusable
    cached: int             # unowned full blocks kept for prefix reuse (evictable)
    tokens: int             # slots holding a token, in used blocks
    allocated_slots: int    # slots in used blocks
    unshared_blocks: int    # blocks the block tables would need without sharing
    offloaded: int = 0      # host blocks holding cold blocks of long sequences

    @property
    def waste(self) -> float:
        """Fraction of allocated slots that hold no token."""
        return 1 - self.tokens / self.allocated_slots if self.allocated_slots else 0.0


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None        # set once the block is full and registered in the cache
    token_ids: tuple[int, ...] = ()  # compared on every hit, so a hash collision cannot alias


def block_hash(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """A full block is named by its tokens and everything before them (its parent's hash)."""
    digest = hashlib.sha256(parent or b"")
    digest.update(",".join(map(str, token_ids)).encode())
    return digest.digest()


def salt_root(salt: str | None) -> bytes | None:
    """The parent hash of a salted sequence's first block: sequences with different salts never
    share a cached block, so one tenant cannot learn from hits what another one sent."""
    return None if salt is None else hashlib.sha256(b"cache_salt:" + salt.encode()).digest()


@dataclass
class PrefixStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # not computed: found in the pool, or in the remote tier
    remote_tokens: int = 0  # of those, loaded from the remote tier

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class PromptGrant:
    """A prompt's blocks were given: how many of its tokens need no computing, and the blocks the
    remote tier serves, to be loaded before the step runs."""
    cached: int                                # tokens in the pool, or arriving with `loads`
    loads: tuple[tuple[int, bytes], ...] = ()  # (device block, its pages from the remote tier)


class HostBlock(int):
    """A table entry that lives in host memory: an offloaded block. Its value is the id kernels
    address it by (the device pool's size + `host_index`), so block tables stay plain integer
    tensors; Python code asks `isinstance(b, HostBlock)` instead of comparing ids."""
    host_index: int

    def __new__(cls, host_index: int, num_device_blocks: int) -> "HostBlock":
        block = super().__new__(cls, num_device_blocks + host_index)
        block.host_index = host_index
        return block


def on_device(block_id: int) -> bool:
    return not isinstance(block_id, HostBlock)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, remote: RemoteKVTier | None = None) -> None:
        """`remote`: a shared tier asked for the full blocks after a prompt's local prefix hit
        (cache/kv_remote.py); what it serves is loaded into new blocks before the step runs."""
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cache: dict[bytes, int] = {}
        self.tables: dict[str, list[int]] = {}
        self.num_tokens: dict[str, int] = {}
        self._hashes: dict[str, list[bytes]] = {}  # each sequence's registered full-block hashes
        self._roots: dict[str, bytes] = {}          # salted sequences' first parent hash
        self.prefix_stats = PrefixStats()
        self.num_host_blocks = num_host_blocks
        self._host_free = [HostBlock(i, num_blocks) for i in reversed(range(num_host_blocks))]
        self.remote = remote
        self.evicted_blocks = 0  # blocks returned to the pool by compaction, since the start
        self.peak_used = 0

    @property
    def free_blocks(self) -> list[int]:
        """Unowned blocks (cached ones included), in the order they would be reused."""
        return list(self._free)

    def sequence_state_left(self) -> list[str]:
        """The per-sequence state this block manager holds (none, once every sequence is freed)."""
        left = [f"{name} of sequences {sorted(held)[:8]}" for name, held in (
            ("block tables", self.tables), ("token counts", self.num_tokens), ("registered hashes", self._hashes),
            ("salted roots", self._roots)) if held]
        if in_use := self.num_host_blocks - len(self._host_free):
            left.append(f"{in_use} host (offload) blocks in use")
        return left

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- taking and returning blocks ------------------------------------------------------------
    def _uncache(self, block: Block) -> None:
        del self.cache[block.hash]
        block.hash, block.token_ids = None, ()

    def _forget(self, block_id: int) -> None:
        """Drop an unowned block from the prefix cache; it is then reused before cached ones."""
        self._uncache(self.blocks[block_id])
        self._free.move_to_end(block_id, last=False)

    def _take_free(self) -> int:
        block_id = next(iter(self._free))
        if self.blocks[block_id].hash is not None:  # evict: its contents are about to be overwritten
            self._forget(block_id)
        del self._free[block_id]
        self.blocks[block_id].ref_count = 1
        return block_id

    def _share(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.hash is None:
                self._free.move_to_end(block_id, last=False)

    def _note_peak(self) -> None:
        self.peak_used = max(self.peak_used, self.num_blocks - len(self._free))

    def allocate_prompt(self, seq_id: str, token_ids: list[int], reserve_tokens: int = 0,
                        max_cached: int | None = None, salt: str | None = None,
                        prefill_chunk: int | None = None) -> PromptGrant | None:
        """Give a new sequence its blocks, reusing its longest cached prefix of at most
        `max_cached` tokens (None: any) among blocks cached under the same `salt`; with
        `prefill_chunk`, blocks only up to the next multiple of it past that prefix (a prompt that
        runs, and is evicted, chunk by chunk). Returns how many tokens are already in the pool (or
        come from the remote tier, with the loads that bring them), or None (changing nothing) if
        blocks are short."""
        hits: list[int] = []
        hashes: list[bytes] = []
        root = salt_root(salt)
        # The last prompt token is always computed: its logits give the first output token.
        most = (len(token_ids) - 1) // self.block_size
        if max_cached is not None:
            most = min(most, max_cached // self.block_size)
        if self.enable_prefix_caching:
            parent = root
            for i in range(most):
                chunk = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
                parent = block_hash(parent, chunk)
                block_id = self.cache.get(parent)
                if block_id is None or self.blocks[block_id].token_ids != chunk:
                    break
                hits.append(block_id)
                hashes.append(parent)
        cached = len(hits) * self.block_size
        room = len(token_ids) if prefill_chunk is None else \
            min(len(token_ids), (cached // prefill_chunk + 1) * prefill_chunk)
        need = self.blocks_for(max(room, reserve_tokens)) - len(hits)
        reusable = sum(self.blocks[b].ref_count == 0 for b in hits)
        if need > len(self._free) - reusable:
            return None
        for block_id in hits:
            self._share(block_id)
        fresh = [self._take_free() for _ in range(need)]
        self.tables[seq_id] = hits + fresh
        loads: tuple[tuple[int, bytes], ...] = ()
        if self.remote is not None and self.enable_prefix_caching and prefill_chunk is None:
            loads = self._load_remote(token_ids, most, hashes, fresh, parent=hashes[-1] if hashes else root)
            self.prefix_stats.remote_tokens += len(loads) * self.block_size
            cached += len(loads) * self.block_size
        self.num_tokens[seq_id] = room
        self._hashes[seq_id] = hashes
        if root is not None:
            self._roots[seq_id] = root
        self.prefix_stats.prompt_tokens += len(token_ids)
        self.prefix_stats.cached_tokens += cached
        self._note_peak()
        return PromptGrant(cached, loads)

    def _load_remote(self, token_ids: list[int], most: int, hashes: list[bytes], fresh: list[int],
                     parent: bytes | None) -> tuple[tuple[int, bytes], ...]:
        """Asks the remote tier for the full blocks after the local hit (`hashes`, extended in
        place with the ones it serves) up to the `most`-th, which go into the first `fresh`
        blocks, cached at once. Returns the (block, pages) loads that fill them."""
        bs = self.block_size
        wanted: list[tuple[bytes, tuple[int, ...]]] = []
        for i in range(len(hashes), most):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = block_hash(parent, chunk)
            wanted.append((parent, chunk))
        payloads = self.remote.fetch([h for h, _ in wanted])
        loads = []
        for block_id, (h, chunk), payload in zip(fresh, wanted, payloads):
            loads.append((block_id, payload))
            hashes.append(h)
            if h not in self.cache:
                block = self.blocks[block_id]
                block.hash, block.token_ids = h, chunk
                self.cache[h] = block_id
        return tuple(loads)

    def roll_back(self, granted: list[tuple[str, int, PromptGrant]]) -> None:
        """Undoes `allocate_prompt` for (sequence, prompt length, grant) of a group that did not
        fit whole: the blocks go back, their remote loads will not run (those blocks leave the
        prefix cache, since they will never hold those pages: they may be reused in this very
        step), and the prefix statistics forget them (the group counts once it is admitted)."""
        for seq_id, _, _ in granted:  # every member first: one may share a block loaded for another
            self.free(seq_id)
        for _, num_tokens, grant in granted:
            self.prefix_stats.prompt_tokens -= num_tokens
            self.prefix_stats.cached_tokens -= grant.cached
            self.prefix_stats.remote_tokens -= len(grant.loads) * self.block_size
            for block_id, _ in grant.loads:
                block = self.blocks[block_id]
                if block.ref_count == 0 and block.hash is not None:
                    self._forget(block_id)

    def allocate(self, seq_id: str, num_tokens: int, reserve_tokens: int = 0,
                 salt: str | None = None) -> tuple[tuple[int, int], ...] | None:
        """Grow `seq_id`'s table to hold `max(num_tokens, reserve_tokens)` slots, record that it
        holds `num_tokens` tokens, and make the block the newest token lands in its own (copy on
        write). Returns the copy-on-write copies (source, destination) the runner must make before
        the step writes, possibly none; allocates nothing and returns None if blocks are short.
        `salt`: for a new table (a sequence swapped back in), the cache salt its blocks are
        registered under."""
        table = self.tables.get(seq_id)
        bs = self.block_size
        # Most calls (a decode into a block the sequence owns alone) change nothing but the count.
        if table is not None and 0 < num_tokens and max(num_tokens, reserve_tokens) <= len(table) * bs:
            block = table[(num_tokens - 1) // bs]
            if on_device(block) and self.blocks[block].ref_count == 1:
                self.num_tokens[seq_id] = num_tokens
                return ()
        new = table is None
        table = [] if new else table
        need = -(-max(num_tokens, reserve_tokens) // bs) - len(table)
        last = (num_tokens - 1) // bs
        shared_last = (0 <= last < len(table) and on_device(table[last])
                       and self.blocks[table[last]].ref_count > 1)
        if need + shared_last > len(self._free):
            return None
        if new:
            self.tables[seq_id], self._hashes[seq_id] = table, []
            if salt is not None:
                self._roots[seq_id] = salt_root(salt)
        if need > 0:
            table.extend(self._take_free() for _ in range(need))
        copies: tuple[tuple[int, int], ...] = ()
        if shared_last:
            copy = self._take_free()
            copies = ((table[last], copy),)
            self._release(table[last])
            table[last] = copy
        self.num_tokens[seq_id] = num_tokens
        if need > 0 or shared_last:
            self._note_peak()
        return copies

    def compact(self, seq_id: str, layer: torch.Tensor, head: torch.Tensor, src: torch.Tensor,
                dst: torch.Tensor, kept: int) -> Compaction | None:
        """Token eviction: slot `src` moves into slot `dst` (indices within the sequence) per
        (layer, head), the sequence keeps `kept` slots, and the blocks past them return to the
        pool. A block it writes (a destination, or the partial block new tokens will fill) is
        made its own first: copied when shared or registered in the prefix cache (the original
        stays cached), else, when blocks are short, dropped from the cache, since its contents
        will no longer match its tokens. Returns the moves for the pool, which must be applied
        before any block the sequence gave back is written again; None, changing nothing, when
        blocks for the copies of shared blocks are short."""
        table = self.tables[seq_id]
        bs = self.block_size
        keep_blocks = self.blocks_for(kept)
        assert all(map(on_device, table)), "offloaded sequences do not evict (EngineConfig checks)"
        written = set((dst // bs).tolist())
        if kept % bs:
            written.add(kept // bs)
        shared = [i for i in sorted(written) if self.blocks[table[i]].ref_count > 1]
        if len(shared) > len(self._free):
            return None
        # A cached block is copied too while blocks allow, so that the prefix stays servable.
        cached = [i for i in sorted(written) if self.blocks[table[i]].hash is not None and i not in shared]
        copied = sorted(shared + cached) if len(shared) + len(cached) <= len(self._free) else shared
        copies = []
        # Fresh blocks are taken before the tail is released: a copy must not land on a source.
        for i in copied:
            fresh = self._take_free()
            copies.append((table[i], fresh))
            self._release(table[i])
            table[i] = fresh
        self._note_peak()
        for i in written - set(copied):
            if self.blocks[table[i]].hash is not None:
                self._uncache(self.blocks[table[i]])
        # Sources may sit in the tail: their pool slots are taken before it is released (the
        # caller applies the compaction before any other move can reuse those blocks).
        blocks = torch.tensor(table, dtype=torch.long)
        compaction = Compaction(tuple(copies), layer, head, blocks[src // bs] * bs + src % bs,
                                blocks[dst // bs] * bs + dst % bs)
        for block_id in reversed(table[keep_blocks:]):
            self._release(block_id)
        self.evicted_blocks += len(table) - keep_blocks
        del table[keep_blocks:]
        self.num_tokens[seq_id] = kept
        return compaction

    def offload_coldest(self, seq_id: str) -> tuple[int, HostBlock] | None:
        """Move the sequence's oldest device block that only it owns to a host block, freeing the
        device block. Its last block stays: the next token may be written there. Returns the
        (device block, host block) copy to make before the device block is reused, or None when
        no block can go."""
        table = self.tables[seq_id]
        for i, block_id in enumerate(table[:-1]):
            if on_device(block_id) and self.blocks[block_id].ref_count == 1 and self._host_free:
                host = self._host_free.pop()
                table[i] = host
                self._release(block_id)
                return block_id, host
        return None

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent; writes are copied on demand."""
        assert all(map(on_device, self.tables[parent_id])), "offloaded sequences do not fork"
        for block_id in self.tables[parent_id]:
            self._share(block_id)
        self.tables[child_id] = list(self.tables[parent_id])
        self.num_tokens[child_id] = self.num_tokens[parent_id]
        self._hashes[child_id] = list(self._hashes[parent_id])
        if parent_id in self._roots:
            self._roots[child_id] = self._roots[parent_id]

    def has_unregistered_blocks(self, seq_id: str, num_computed: int) -> bool:
        """Whether `register_full_blocks` would hash a block: asked first, it spares the caller
        building a sequence's token list on the steps (most) that fill no block."""
        return self.enable_prefix_caching and len(self._hashes[seq_id]) < num_computed // self.block_size

    def register_full_blocks(self, seq_id: str, token_ids: list[int], num_computed: int) -> list[tuple[int, bytes]]:
        """Put the sequence's newly filled blocks (their K/V written) into the prefix cache.
        Returns the (block, hash) pairs that joined it, for the remote tier."""
        if not self.has_unregistered_blocks(seq_id, num_computed):
            return []
        joined: list[tuple[int, bytes]] = []
        hashes = self._hashes[seq_id]
        table = self.tables[seq_id]
        for i in range(len(hashes), num_computed // self.block_size):
            chunk = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = block_hash(hashes[-1] if hashes else self._roots.get(seq_id), chunk)
            hashes.append(h)
            if not on_device(table[i]):  # offloaded: registered before it left the device
                continue
            block = self.blocks[table[i]]
            if block.hash is not None:
                continue
            twin = self.cache.get(h)
            if twin is not None and self.blocks[twin].ref_count == 0:
                # Two sequences computed the same block; keep the live copy cached, so the entry
                # survives the unowned twin's eviction. The twin becomes a plain free block.
                self._forget(twin)
                twin = None
            if twin is None:
                block.hash, block.token_ids = h, chunk
                self.cache[h] = block.block_id
                joined.append((block.block_id, h))
        return joined

    def free(self, seq_id: str) -> None:
        # Deepest block first: among blocks freed together, the deeper is evicted first.
        for block_id in reversed(self.tables.pop(seq_id, [])):
            if isinstance(block_id, HostBlock):
                self._host_free.append(block_id)
            else:
                self._release(block_id)
        self.num_tokens.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        self._roots.pop(seq_id, None)

    def block_states(self) -> tuple[str, list[str | None]]:
        """Per device block, its state as one letter (F free, U in use, S shared, C cached) and
        the sequence whose table holds it first (None when unowned): the dashboard's grid."""
        owners: list[str | None] = [None] * self.num_blocks
        for seq_id, table in self.tables.items():
            for block_id in table:
                if on_device(block_id) and owners[block_id] is None:
                    owners[block_id] = seq_id
        states = "".join(
            ("S" if b.ref_count > 1 else "U") if b.ref_count else ("C" if b.hash is not None else "F")
            for b in self.blocks)
        return states, owners

    def usage(self) -> BlockUsage:
        filled: dict[int, int] = {}
        for seq_id, table in self.tables.items():
            n = self.num_tokens[seq_id]
            for i, block_id in enumerate(table):
                if not on_device(block_id):
                    continue
                filled[block_id] = max(filled.get(block_id, 0), min(self.block_size, max(0, n - i * self.block_size)))
        cached = sum(self.blocks[b].hash is not None for b in self._free)
        return BlockUsage(total=self.num_blocks, used=self.num_blocks - len(self._free),
                          free=len(self._free) - cached, cached=cached, tokens=sum(filled.values()),
                          allocated_slots=len(filled) * self.block_size,
                          unshared_blocks=sum(len(t) for t in self.tables.values()),
                          offloaded=sum(not on_device(b) for t in self.tables.values() for b in t))
