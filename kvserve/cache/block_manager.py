"""Gives each sequence a block table per KV cache group, from one pool of blocks shared by
reference count, whose full blocks join a prefix cache (cache/block_pool.py); among blocks freed
together, the deepest is evicted first.

Every method that decides a block move returns it and keeps nothing for later: `allocate` the
copy-on-write copies, `allocate_prompt` a `PromptGrant` (with the remote tier's loads),
`offload_coldest` the (device, host) pair, `compact` a `Compaction`; the caller sends them to the
runner in a `BlockOps`.

KV cache groups (cache/kv_groups.py) draw from the one free queue. A sliding group's table
releases each block its window no longer sees (`NULL_BLOCK` takes its place), and a prompt's
prefix hit is usable up to k blocks when every full group holds those k blocks and every sliding
group holds the ones its window sees from position k x block_size (the blocks before may be long
gone): the tokens from there on are computed, and read nothing else.
"""
from __future__ import annotations

import torch

from kvserve.cache.block_pool import BlockPool
from kvserve.cache.blocks import (BlockUsage, HostBlock, PrefixStats, PromptGrant, block_hash, on_device,
                                  salt_root)
from kvserve.cache.compaction import Compaction
from kvserve.cache.kv_groups import NULL_BLOCK, KVSpec
from kvserve.cache.block_tier import BlockTier
from kvserve.cache.staging_slots import StagingSlots
from kvserve.cache.table_widths import TableWidths


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, remote: BlockTier | None = None,
                 specs: tuple[KVSpec, ...] = (KVSpec(),), step_tokens: int | None = None, staging_slots: int = 0,
                 residual: int = 0, events_medium: str | None = None) -> None:
        """`remote`: a shared tier asked for the full blocks after a prompt's local prefix hit
        (cache/kv_remote.py); what it serves is loaded into new blocks before the step runs.
        `specs`: each KV cache group's spec (one full group: a plain paged cache). `step_tokens`:
        the most tokens a step runs of one sequence (chunked prefill), so a sliding group holds
        blocks only that far past the computed tokens; None: a prompt runs whole. `staging_slots`
        and `residual`: a compressed pool's full-precision slots and window (staging_slots.py).
        `events_medium`: record KV events (cache/kv_events.py) under this medium name."""
        self.num_blocks, self.block_size, self.enable_prefix_caching = num_blocks, block_size, enable_prefix_caching
        self.specs, self.widths = specs, TableWidths(specs, block_size, step_tokens)
        self.pool = BlockPool(num_blocks, len(specs), any(spec.window is not None for spec in specs), events_medium)
        self.blocks = self.pool.blocks
        self.staging = StagingSlots(staging_slots, block_size, residual, self.blocks) if staging_slots else None
        self.group_tables: list[dict[str, list[int]]] = [{} for _ in specs]
        self._dropped: list[dict[str, int]] = [{} for _ in specs]  # leading entries a window released
        self.num_tokens: dict[str, int] = {}
        self._hashes: dict[str, list[bytes]] = {}  # each sequence's registered full-block hashes
        self._roots: dict[str, bytes] = {}          # salted sequences' first parent hash
        self.prefix_stats = PrefixStats()
        self.num_host_blocks, self.remote = num_host_blocks, remote
        self._host_free = [HostBlock(i, num_blocks) for i in reversed(range(num_host_blocks))]
        self.evicted_blocks = self.peak_used = 0  # since the start: blocks compaction freed; most used at once

    @property
    def tables(self) -> dict[str, list[int]]:
        """The first group's tables (the full-attention one, where a model has one): what swaps,
        offloads and evictions move, which only single-group caches do (EngineConfig checks)."""
        return self.group_tables[0]

    @property
    def cache(self) -> dict[bytes, int]:
        """The first group's prefix cache: hash -> block."""
        return self.pool.caches[0]

    def tables_of(self, seq_id: str) -> tuple[list[int], ...]:
        """The sequence's block table in each group."""
        return tuple(tables[seq_id] for tables in self.group_tables)

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def reserved(self) -> int:
        return self.pool.reserved

    @property
    def free_blocks(self) -> list[int]:
        """Unowned blocks (cached ones included), in the order they would be reused."""
        return list(self.pool.free)

    def sequence_state_left(self) -> list[str]:
        """The per-sequence state this block manager holds (none, once every sequence is freed)."""
        held = [("token counts", self.num_tokens), ("registered hashes", self._hashes), ("salted roots", self._roots),
                *((f"group {g} block tables", t) for g, t in enumerate(self.group_tables)),
                *((f"group {g} window marks", d) for g, d in enumerate(self._dropped))]
        left = [f"{name} of sequences {sorted(state)[:8]}" for name, state in held if state]
        if in_use := self.num_host_blocks - len(self._host_free):
            left.append(f"{in_use} host (offload) blocks in use")
        return left

    def blocks_for(self, num_tokens: int) -> int:
        return self.widths.blocks_for(num_tokens)

    def blocks_peak(self, num_tokens: int) -> int:
        """`TableWidths.peak`: one needing over `capacity` could never run alone."""
        return self.widths.peak(num_tokens)

    def blocks_held(self, num_tokens: int) -> int:
        return self.widths.held(num_tokens)

    def _note_peak(self) -> None:
        self.peak_used = max(self.peak_used, self.pool.used)

    def _prefix_hits(self, token_ids: list[int], most: int,
                     root: bytes | None) -> tuple[int, list[bytes], list[list[int | None]]]:
        """The longest usable prefix hit, in blocks (see the module's rule), with the hashes of its
        blocks and, per group, each of those blocks' cached copy (None where a window needs none)."""
        hashes: list[bytes] = []
        found: list[list[int | None]] = [[] for _ in self.specs]
        parent = root
        for i in range(most):
            chunk = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent = block_hash(parent, chunk)
            hits = [self.pool.cached(g, parent, chunk) for g in range(len(self.specs))]
            if any(hit is None and spec.window is None for hit, spec in zip(hits, self.specs)):
                break
            hashes.append(parent)
            for held, hit in zip(found, hits):
                held.append(hit)
        k = len(hashes)
        for spec, held in zip(self.specs, found):
            while spec.window is not None and k and None in held[spec.first_needed(k * self.block_size)
                                                                  // self.block_size:k]:
                k -= 1
        return k, hashes[:k], [held[:k] for held in found]

    def allocate_prompt(self, seq_id: str, token_ids: list[int], reserve_tokens: int = 0,
                        max_cached: int | None = None, salt: str | None = None,
                        prefill_chunk: int | None = None) -> PromptGrant | None:
        """Give a new sequence its blocks, reusing its longest cached prefix of at most
        `max_cached` tokens (None: any) among blocks cached under the same `salt`; with
        `prefill_chunk`, blocks only up to the next multiple of it past that prefix (a prompt that
        runs, and is evicted, chunk by chunk). Returns how many tokens are already in the pool (or
        come from the remote tier, with the loads that bring them), or None (changing nothing) if
        blocks are short."""
        root = salt_root(salt)
        # The last prompt token is always computed: its logits give the first output token.
        most = (len(token_ids) - 1) // self.block_size
        if max_cached is not None:
            most = min(most, max_cached // self.block_size)
        k, hashes, found = self._prefix_hits(token_ids, most if self.enable_prefix_caching else 0, root)
        cached = k * self.block_size
        room = len(token_ids) if prefill_chunk is None else \
            min(len(token_ids), (cached // prefill_chunk + 1) * prefill_chunk)
        widths = [self.widths.width(spec, max(room, reserve_tokens), cached) for spec in self.specs]
        # Per group: the cached blocks it reuses, NULL where its window needs none.
        reused = [[NULL_BLOCK if hit is None or i < spec.first_needed(cached) // self.block_size else hit
                   for i, hit in enumerate(held)] for spec, held in zip(self.specs, found)]
        hits = [b for table in reused for b in table if self.pool.owned(b)]
        need = sum(widths) - len(self.specs) * k
        if need > len(self.pool.free) - len({b for b in hits if self.blocks[b].ref_count == 0}):
            return None
        for block_id in hits:
            self.pool.share(block_id)
        fresh: list[int] = []
        for g, table in enumerate(reused):
            new = [self.pool.take() for _ in range(widths[g] - k)]
            fresh += new if g == 0 else []
            self.group_tables[g][seq_id] = table + new
            if self.specs[g].window is not None:
                self._dropped[g][seq_id] = self.specs[g].first_needed(cached) // self.block_size
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
        blocks, cached at once. Returns the (block, pages) loads that fill them. Only one group's
        cache has a remote tier (EngineConfig checks)."""
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
            if h not in self.cache:
                self.pool.register(0, block_id, h, chunk, hashes[-1] if hashes else None)
            hashes.append(h)
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
                    self.pool.forget(block_id)

    def allocate(self, seq_id: str, num_tokens: int, reserve_tokens: int = 0, salt: str | None = None,
                 num_computed: int | None = None) -> tuple[tuple[int, int], ...] | None:
        """Grow `seq_id`'s tables to hold `max(num_tokens, reserve_tokens)` slots, record that it
        holds `num_tokens` tokens, and make the block the newest token lands in its own (copy on
        write). Returns the copy-on-write copies (source, destination) the runner must make before
        the step writes, possibly none; allocates nothing and returns None if blocks are short.
        `salt`: for a new table (a sequence swapped back in), the cache salt its blocks are
        registered under. `num_computed`: tokens already computed (default: all but the last),
        before whose window's start a sliding group's blocks are released."""
        bs = self.block_size
        last = (num_tokens - 1) // bs
        first = num_tokens - 1 if num_computed is None else num_computed
        plans, credit = [], 0
        for g, spec in enumerate(self.specs):
            table = self.group_tables[g].get(seq_id)
            width = self.widths.width(spec, max(num_tokens, reserve_tokens), first)
            newest = min(last, width - 1)  # a sliding group's table may stop short of a prompt's end
            drop = spec.first_needed(first) // bs
            # Most calls (a decode into a block the sequence owns alone) change nothing but the count.
            if table is not None and 0 < num_tokens and width <= len(table) and drop <= self._dropped[g].get(seq_id, 0):
                block = table[newest]
                if on_device(block) and self.blocks[block].ref_count == 1:
                    continue
            size = 0 if table is None else len(table)
            if table is not None and spec.window is not None:
                # Blocks this call's window releases come back before any is taken.
                credit += sum(self.blocks[table[i]].ref_count == 1 for i in self._out_of_window(g, seq_id, drop))
            shared = 0 <= newest < size and on_device(table[newest]) and self.blocks[table[newest]].ref_count > 1
            plans.append((g, size, max(0, width - size), shared, drop, newest))
        if not plans:
            self.num_tokens[seq_id] = num_tokens
            return ()
        # Entries before the window's start are the null block, not taken from the pool.
        taken = sum(max(0, size + need - max(size, drop)) + shared for _, size, need, shared, drop, _ in plans)
        if taken > len(self.pool.free) + credit:
            return None
        for g, _, _, _, drop, _ in plans:
            if seq_id in self._dropped[g]:  # a sliding group's table, made before this call
                self._drop_out_of_window(g, seq_id, drop)
        copies: list[tuple[int, int]] = []
        for g, _, need, shared, drop, newest in plans:
            copies += self._grow(g, seq_id, need, shared, drop, newest, salt)
        self.num_tokens[seq_id] = num_tokens
        self._note_peak()
        return tuple(copies)

    def _grow(self, g: int, seq_id: str, need: int, shared_last: bool, drop: int, last: int,
              salt: str | None) -> list[tuple[int, int]]:
        """`allocate`'s moves in group `g`, after its window dropped what it left behind: append
        `need` entries (the null block before the window's start `drop`), copy the shared last one.
        Returns that copy, if any."""
        table = self.group_tables[g].get(seq_id)
        if table is None:
            table = self.group_tables[g][seq_id] = []
            self._hashes.setdefault(seq_id, [])
            if salt is not None:
                self._roots[seq_id] = salt_root(salt)
            if self.specs[g].window is not None:
                self._dropped[g][seq_id] = drop
        size = len(table)
        table.extend(NULL_BLOCK if size + i < drop else self.pool.take() for i in range(need))
        if not shared_last:
            return []
        copy = self.pool.take()
        self.pool.release(table[last])
        source, table[last] = table[last], copy
        return [(source, copy)]

    def _out_of_window(self, g: int, seq_id: str, drop: int) -> list[int]:
        """The table entries before block `drop` (which the group's window no longer sees) that
        still name a block."""
        table = self.group_tables[g][seq_id]
        return [i for i in range(self._dropped[g][seq_id], min(drop, len(table))) if table[i] != NULL_BLOCK]

    def _drop_out_of_window(self, g: int, seq_id: str, drop: int) -> None:
        """Releases the group's blocks before block `drop`."""
        table = self.group_tables[g][seq_id]
        for i in self._out_of_window(g, seq_id, drop):
            self.pool.release(table[i])
            table[i] = NULL_BLOCK
        self._dropped[g][seq_id] = max(self._dropped[g][seq_id], drop)

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
        if len(shared) > len(self.pool.free):
            return None
        # A cached block is copied too while blocks allow, so that the prefix stays servable.
        cached = [i for i in sorted(written) if self.blocks[table[i]].hash is not None and i not in shared]
        copied = sorted(shared + cached) if len(shared) + len(cached) <= len(self.pool.free) else shared
        copies = []
        # Fresh blocks are taken before the tail is released: a copy must not land on a source.
        for i in copied:
            fresh = self.pool.take()
            copies.append((table[i], fresh))
            self.pool.release(table[i])
            table[i] = fresh
        self._note_peak()
        for i in written - set(copied):
            if self.blocks[table[i]].hash is not None:
                self.pool.uncache(self.blocks[table[i]])
        # Sources may sit in the tail: their pool slots are taken before it is released (the
        # caller applies the compaction before any other move can reuse those blocks).
        blocks = torch.tensor(table, dtype=torch.long)
        compaction = Compaction(tuple(copies), layer, head, blocks[src // bs] * bs + src % bs,
                                blocks[dst // bs] * bs + dst % bs)
        for block_id in reversed(table[keep_blocks:]):
            self.pool.release(block_id)
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
                self.pool.release(block_id)
                return block_id, host
        return None

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent, in every group; writes are copied on demand."""
        assert all(map(on_device, self.tables[parent_id])), "offloaded sequences do not fork"
        for g, tables in enumerate(self.group_tables):
            for block_id in tables[parent_id]:
                if self.pool.owned(block_id):
                    self.pool.share(block_id)
            tables[child_id] = list(tables[parent_id])
            if parent_id in self._dropped[g]:
                self._dropped[g][child_id] = self._dropped[g][parent_id]
        self.num_tokens[child_id] = self.num_tokens[parent_id]
        self._hashes[child_id] = list(self._hashes[parent_id])
        if parent_id in self._roots:
            self._roots[child_id] = self._roots[parent_id]

    def has_unregistered_blocks(self, seq_id: str, num_computed: int) -> bool:
        """Whether `register_full_blocks` would hash a block: asked first, it spares the caller
        building a sequence's token list on the steps (most) that fill no block."""
        return self.enable_prefix_caching and len(self._hashes[seq_id]) < num_computed // self.block_size

    def register_full_blocks(self, seq_id: str, token_ids: list[int], num_computed: int) -> list[tuple[int, bytes]]:
        """Put the sequence's newly filled blocks (their K/V written) into each group's prefix
        cache. Returns the (block, hash) pairs that joined the first group's, for the remote tier."""
        if not self.has_unregistered_blocks(seq_id, num_computed):
            return []
        joined: list[tuple[int, bytes]] = []
        hashes = self._hashes[seq_id]
        for i in range(len(hashes), num_computed // self.block_size):
            chunk = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = block_hash(hashes[-1] if hashes else self._roots.get(seq_id), chunk)
            parent = hashes[-1] if hashes else None  # a salt's root names no block
            hashes.append(h)
            for g, tables in enumerate(self.group_tables):
                block_id = tables[seq_id][i]
                # Offloaded: registered before it left the device; NULL: out of its group's window.
                if on_device(block_id) and self.pool.owned(block_id) and \
                        self.pool.register(g, block_id, h, chunk, parent) and g == 0:
                    joined.append((block_id, h))
        return joined

    def free(self, seq_id: str) -> None:
        # Deepest block first: among blocks freed together, the deeper is evicted first.
        for g, tables in enumerate(self.group_tables):
            for block_id in reversed(tables.pop(seq_id, [])):
                if isinstance(block_id, HostBlock):
                    self._host_free.append(block_id)
                elif self.pool.owned(block_id):
                    self.pool.release(block_id)
            self._dropped[g].pop(seq_id, None)
        self.num_tokens.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        self._roots.pop(seq_id, None)

    def trim(self, seq_id: str, num_tokens: int) -> None:
        """Speculation's rollback: the sequence holds at most `num_tokens` slots again (the last
        may still be to take), and each table gives back its blocks past them, written by rejected
        draft tokens alone (never registered: a block joins the prefix cache once its every token
        is computed)."""
        keep = self.blocks_for(num_tokens)
        for tables in self.group_tables:
            table = tables[seq_id]
            for block_id in reversed(table[keep:]):
                self.pool.release(block_id)
            del table[keep:]
        self.num_tokens[seq_id] = min(self.num_tokens[seq_id], num_tokens)

    def group_blocks(self) -> list[int]:
        """Blocks each group's tables hold (a block shared within a group counted once)."""
        return [len({b for table in tables.values() for b in table if on_device(b) and self.pool.owned(b)})
                for tables in self.group_tables]

    def _held(self) -> list[tuple[str, int, list[int]]]:
        """(sequence, group, table) of every block table."""
        return [(seq_id, g, table) for g, tables in enumerate(self.group_tables) for seq_id, table in tables.items()]

    def usage(self) -> BlockUsage:
        filled: dict[int, int] = {}
        for seq_id, _, table in self._held():
            n = self.num_tokens[seq_id]
            for i, block_id in enumerate(table):
                if not on_device(block_id) or not self.pool.owned(block_id):
                    continue
                filled[block_id] = max(filled.get(block_id, 0), min(self.block_size, max(0, n - i * self.block_size)))
        cached = sum(self.blocks[b].hash is not None for b in self.pool.free)
        return BlockUsage(total=self.capacity, used=self.capacity - len(self.pool.free),
                          free=len(self.pool.free) - cached, cached=cached, tokens=sum(filled.values()),
                          allocated_slots=len(filled) * self.block_size,
                          unshared_blocks=sum(self.pool.owned(b) for _, _, t in self._held() for b in t),
                          offloaded=sum(not on_device(b) for _, _, t in self._held() for b in t))
