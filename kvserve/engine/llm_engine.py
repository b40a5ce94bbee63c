"""The engine: takes requests, steps the scheduler and model, and reports outputs."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import numbers
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from kvserve.attention import make_backend
from kvserve.attention.rotation import kv_rotation
from kvserve.cache.block_bytes import block_nbytes, read_blocks
from kvserve.cache.block_manager import BlockManager, BlockUsage
from kvserve.cache.block_ops import BlockOps
from kvserve.cache.quantized_pool import QuantizedKVPool
from kvserve.cache.compaction import Compaction
from kvserve.cache.kv_remote import RemoteKVTier
from kvserve.cache.kv_sizes import KVSizes
from kvserve.cache.swap_space import SwapSpace
from kvserve.config import EngineConfig, parse_bytes
from kvserve.device_copy import to_device
from kvserve.distributed.sharding import shard_config, shard_model, shard_of
from kvserve.distributed.tp_group import TPGroup
from kvserve.engine.beam_search import BeamGroup
from kvserve.engine.detokenizer import Detokenizer
from kvserve.engine.rank_setup import make_pool, rank_formats
from kvserve.engine.tp_worker import tp_worker_main
from kvserve.engine.remote_namespace import remote_namespace
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.penalties import apply_penalties
from kvserve.engine.pending_tokens import PendingTokens
from kvserve.engine.logprobs import prompt_span, token_logprobs
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.engine.sequence import PLACEHOLDER, RequestOutput, Sequence, SequenceStatus, TokenLogprobs
from kvserve.eviction.state import EvictionState
from kvserve.kernels import cpu_extension
from kvserve.model.loader import load_model
from kvserve.profiling import label
from kvserve.sampling_params import SamplingParams
from kvserve.threads import fit_torch_threads
from kvserve.validate import check_utf8

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.torch_device
        if self.device.type == "cpu":
            fit_torch_threads()
        loaded = load_model(config.model, config.torch_dtype, self.device, config.seed)
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.model_name = loaded.name
        cfg = self.model_config
        config.check_model(cfg)
        self.max_model_len = config.max_model_len or cfg.max_position
        self.chunked_prefill = config.enable_chunked_prefill and config.cache_mode == "paged"
        self.max_num_batched_tokens = config.tokens_per_step(self.max_model_len)
        if self.chunked_prefill and self.max_num_batched_tokens < config.max_num_seqs:
            raise ValueError(f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f">= max_num_seqs ({config.max_num_seqs}) so that every running sequence decodes "
                             f"each step")
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f">= max_model_len ({self.max_model_len}) so that any prompt can be prefilled "
                             f"(or enable_chunked_prefill)")

        rotation = kv_rotation(config.kv_rotation, cfg.head_dim, config.seed, config.kv_rotate_keys)
        kernels = cpu_extension.load() if config.cpu_kernels and self.device.type == "cpu" else None
        # With tensor parallelism this process is rank 0: its pool holds its own KV heads, the
        # most of any rank, so the block count it derives from the budget fits every rank.
        world = config.tensor_parallel_size
        shard = shard_of(cfg, 0, world) if world > 1 else None
        formats = rank_formats(config, self.model, self.tokenizer, kernels, rotation, shard)
        pool_cfg = cfg if shard is None else shard_config(cfg, shard)
        if shard is not None and shard.replicated_kv:
            logger.warning("kvserve: %d KV heads over %d ranks: each KV head is replicated on %d ranks",
                           cfg.num_kv_heads, world, world // cfg.num_kv_heads)
        sizes = KVSizes.of(config, pool_cfg)
        block_bytes, staging = sizes.block_bytes, sizes.staging_slots
        self.kv_bytes_per_token = block_bytes / config.block_size
        budget = config.kv_budget_bytes()
        num_blocks = config.num_blocks_override or (budget - sizes.staging_bytes) // block_bytes
        if num_blocks < 1:
            raise ValueError(f"EngineConfig.kv_cache_memory: {budget} bytes is smaller than one KV block "
                             f"({block_bytes} bytes = {config.block_size} tokens"
                             + (f", after {sizes.staging_bytes} bytes of full-precision staging)"
                                if sizes.staging_bytes else ")"))
        contiguous = config.cache_mode == "contiguous"
        num_host_blocks = parse_bytes(config.offload_memory) // block_bytes if config.cache_mode == "paged" else 0
        if contiguous and -(-self.max_model_len // config.block_size) > num_blocks:
            raise ValueError(f"EngineConfig.kv_cache_memory: contiguous mode preallocates max_model_len "
                             f"({self.max_model_len}) tokens per sequence, more than the "
                             f"{num_blocks * config.block_size} slots the budget holds")
        self.pool = make_pool(config, pool_cfg, num_blocks, formats, staging, num_host_blocks, self.device)
        self.remote = None if config.kv_remote is None else RemoteKVTier(
            config.kv_remote, remote_namespace(self.model, config, formats), block_nbytes(self.pool.block_tensors),
            timeout_s=config.kv_remote_timeout, secret=config.kv_remote_secret)
        # The baselines stand for engines without sharing: no prefix cache for them.
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          config.enable_prefix_caching and config.cache_mode == "paged",
                                          num_host_blocks, self.remote)
        self.swap = None
        if config.preemption_mode != "recompute" and config.cache_mode == "paged":
            self.swap = self._swap_space(block_bytes)
        self._num_params = sum(p.numel() for p in self.model.parameters())
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, self.max_num_batched_tokens,
                                   reserve_tokens=self.max_model_len if contiguous else 0,
                                   recompute_all=config.cache_mode == "no-cache",
                                   swap=self.swap, prefer_swap=self._prefer_swap,
                                   chunked_prefill=self.chunked_prefill)
        self.attention_backend = make_backend(config.attention_backend, self.pool, pool_cfg.num_heads, self.device)
        self.tp = None
        if shard is not None:
            self.tp = TPGroup.start(config, num_blocks, tp_worker_main)
            self.model = shard_model(self.model, shard, self.tp.group)
        self.runner = ModelRunner(self.model, self.pool, self.block_manager, self.device, self.attention_backend,
                                  kernels, self.swap, rotation, self.tp, self._graph_shape(config),
                                  cpu_stack=config.cpu_fused_step and self.device.type == "cpu" and self.tp is None)
        self.eos_token_id = (self.tokenizer.eos_token_id if self.tokenizer is not None
                             else cfg.eos_token_id)
        self.output_processor = OutputProcessor(self.eos_token_id, self.max_model_len)
        self.tokens_computed = 0  # tokens run through the model, prefill and decode
        self.tokens_generated = 0  # tokens sampled, beams and forks included
        self.evicted_tokens: Counter[str] = Counter()  # by policy
        self._requests: dict[str, list[Sequence]] = {}  # unfinished requests: their samples
        self._ids = itertools.count()
        # Where the host's step is a large share of a short device step (CUDA); on a CPU the
        # host and the model share the cores, and a step's tokens are read a step late for nothing.
        self.async_scheduling = config.async_scheduling == "on" or (
            config.async_scheduling == "auto" and self.device.type == "cuda" and self.tp is None)
        self._pending: PendingTokens | None = None  # the last step's tokens, not read yet
        if self.async_scheduling:
            logger.info("kvserve: async scheduling: each step launches before the host reads the tokens of "
                        "the one before")
        self._rng = random.Random(config.seed)

    def _swap_space(self, block_bytes: int) -> SwapSpace:
        config = self.config
        disk = parse_bytes(config.disk_swap_memory)
        try:
            return SwapSpace(self.pool, parse_bytes(config.host_swap_memory) // block_bytes, disk // block_bytes,
                             config.swap_dir)
        except OSError as err:  # the file tier's space, reserved now so that no swap-out finds the disk full
            directory = config.swap_dir or tempfile.gettempdir()
            free = shutil.disk_usage(directory).free
            raise ValueError(f"EngineConfig.disk_swap_memory: cannot reserve {disk} bytes for the swap file in "
                             f"{directory} ({err.strerror}; {free} bytes ({free / 2**20:.1f} MiB) free there): "
                             f"lower disk_swap_memory or set swap_dir to a larger filesystem") from None

    def _graph_shape(self, config: EngineConfig) -> tuple[int, int] | None:
        """(sequences, slots) of the decode steps to capture in CUDA graphs, or None (eager)."""
        if not config.cuda_graphs or self.device.type != "cuda":
            return None
        reason = "tensor parallelism" if self.tp is not None else self.attention_backend.graph_unsupported()
        if reason is not None:
            logger.info("kvserve: decode steps run eagerly, without CUDA graphs: %s", reason)
            return None
        return config.max_num_seqs, self.max_model_len

    # Rough device speeds for the "auto" preemption choice: recomputing a sequence costs about
    # 2 * params FLOPs per token, swapping costs its KV bytes twice (out and back) over the link.
    _FLOPS = {"cpu": 2e11, "cuda": 1e14}
    _COPY_BYTES_PER_S = {"cpu": 2e10, "cuda": 2e10}

    def _prefer_swap(self, num_tokens: int) -> bool:
        if self.config.preemption_mode != "auto":
            return self.config.preemption_mode == "swap"
        kind = self.device.type
        recompute_s = num_tokens * 2 * self._num_params / self._FLOPS.get(kind, 2e11)
        block_bytes = self.pool.nbytes // self.block_manager.num_blocks
        swap_s = 2 * self.block_manager.blocks_for(num_tokens) * block_bytes / self._COPY_BYTES_PER_S.get(kind, 2e10)
        return swap_s < recompute_s

    def fatal_error(self) -> str | None:
        """Why this engine can run no further step (a tensor-parallel rank died), or None."""
        if self.tp is not None:
            dead = self.tp.dead_workers(grace_s=1.0)  # asked after a failed step: waiting is cheap
            if dead:
                return f"tensor-parallel rank(s) {', '.join(dead)} died; the engine cannot continue"
        return None

    def close(self) -> None:
        """Stops the tensor-parallel workers, if any (an engine without them holds no process)."""
        if self.tp is not None:
            self.tp.close()

    # -- requests ---------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            check_utf8("prompt", prompt)
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, Iterable) or isinstance(prompt, (bytes, bytearray)):
            # bytes would pass as token ids (its items are ints): the caller meant text
            raise ValueError(f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}")
        ids = list(prompt)
        # numpy / torch integers are fine; floats and bools (an int to Python) are not token ids.
        # Plain ints are let through first: asking the ABC about every id took ~1 ms for a
        # 512-token prompt.
        if any(type(t) is not int and (not isinstance(t, numbers.Integral) or isinstance(t, (bool, np.bool_)))
               for t in ids):
            raise ValueError("prompt: token ids must be integers")
        return None, [int(t) for t in ids]

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None) -> str:
        return self.add_sequence(self.make_sequence(prompt, params, request_id, cache_salt))

    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None, cache_salt: str | None = None) -> Sequence:
        """Validates a request without touching engine state, so a bad one never disturbs others.
        `cache_salt`: prefix-cache hits only among requests carrying the same salt (a tenant's)."""
        if cache_salt is not None:
            if not isinstance(cache_salt, str) or not cache_salt:
                raise ValueError("cache_salt: must be a non-empty string")
            check_utf8("cache_salt", cache_salt)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: must be SamplingParams, got {type(params).__name__}")
        text, ids = self.encode(prompt)
        if not ids:
            raise ValueError("prompt: empty prompt")
        vocab = self.model_config.vocab_size
        for name, listed in (("prompt", ids), ("forced_token_ids", params.forced_token_ids),
                             ("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            if listed and any(not 0 <= t < vocab for t in listed):
                raise ValueError(f"{name}: token ids must be in [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            if (k := getattr(params, name)) is not None and k > vocab:
                raise ValueError(f"{name}: {k} exceeds the vocabulary ({vocab} tokens); -1 returns all")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} prompt tokens leave no room to generate within the "
                             f"context length max_model_len={self.max_model_len}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens: {len(ids)} prompt tokens + max_tokens {params.max_tokens} exceed "
                             f"the context length max_model_len={self.max_model_len}")
        device_capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if len(ids) > device_capacity:
            raise ValueError(f"prompt: {len(ids)} tokens exceed the device KV pool ({device_capacity} "
                             f"tokens); raise kv_cache_memory")
        capacity = device_capacity + self.block_manager.num_host_blocks * self.block_manager.block_size
        if len(ids) + params.max_tokens > capacity:
            raise ValueError(f"prompt: {len(ids)} prompt tokens + max_tokens {params.max_tokens} exceed "
                             f"the whole KV cache ({capacity} tokens); raise kv_cache_memory")
        request_id = request_id or str(next(self._ids))
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n: {params.n} samples exceed max_num_seqs={self.config.max_num_seqs}")
        # Beams run together and are never offloaded: the device pool must hold them all.
        if params.beam_width > 1 and params.beam_width * (len(ids) + params.max_tokens) > device_capacity:
            raise ValueError(f"beam_width: {params.beam_width} beams of up to {len(ids) + params.max_tokens} "
                             f"tokens must fit the device KV pool together ({device_capacity} tokens)")
        if params.beam_width > self.config.max_num_seqs:
            raise ValueError(f"beam_width: {params.beam_width} beams exceed max_num_seqs={self.config.max_num_seqs}")
        eviction = self.config.eviction_policy(params.kv_eviction, params.kv_budget, owner="SamplingParams")
        if eviction is not None and (reason := self.config.eviction_unsupported()):
            raise ValueError(f"kv_eviction: {reason}")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        beam = None
        if params.beam_width > 1:
            beam = BeamGroup(params.beam_width, params.length_penalty, params.early_stopping,
                             params.max_tokens, None if params.ignore_eos else self.eos_token_id)
        return Sequence(request_id, ids, params, seed, prompt=text,
                        num_forks=max(params.n, params.beam_width) - 1, beam=beam, cache_salt=cache_salt,
                        eviction=eviction, detokenizer=self._detokenizer(),
                        # The first prompt token has no context to score it.
                        prompt_logprobs=[] if params.prompt_logprobs is None else [None])

    def add_sequence(self, seq: Sequence) -> str:
        if seq.request_id in self._requests:
            raise ValueError(f"request_id: {seq.request_id!r} is already in use")
        self._requests[seq.request_id] = [seq]
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: str) -> None:
        """Ends every sample of the request and returns their blocks."""
        for seq in self._requests.pop(request_id, []):
            if seq.output_token_ids[-1:] == [PLACEHOLDER]:  # its token is still on the device: dropped
                seq.output_token_ids.pop()
            if not seq.finished:
                seq.finish_reason = "abort"
                seq.finish_time = time.perf_counter()
                self.scheduler.finish(seq)
        self._settle()

    def is_active(self, request_id: str) -> bool:
        """Whether the request still has samples queued or running."""
        return request_id in self._requests

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def request_state_left(self) -> list[str]:
        """What the engine itself still holds of requests (idle_check)."""
        return ([f"requests {sorted(self._requests)[:8]}"] if self._requests else []) + (
            ["a step's sampled tokens never read"] if self._pending is not None else [])

    # -- stepping ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward pass. Returns an output for every sequence whose new token the host read:
        this step's, and with async scheduling the step before's, read while this one runs."""
        outputs = self._step()
        self._settle()
        return outputs

    def _settle(self) -> None:
        """What finished or aborted sequences leave, given back now, so that an idle engine holds
        nothing of them (engine/idle_check.py): in-flight tokens of sequences that all finished
        (async scheduling: the step after a sequence's last token was launched before its stop
        was read), and staging slots."""
        if self._pending is not None and all(s.finished for s in self._pending.seqs):
            self._pending = None
        self._release_staging()

    def _release_staging(self) -> None:
        """The staging slots of blocks that finished or aborted sequences gave back, returned now
        (a cached one sealed first): an idle compressed pool holds none."""
        if isinstance(self.pool, QuantizedKVPool) and self.pool.staged:
            ops = self.pool.release_unowned(self.block_manager)
            if ops.any():
                self.runner.move_blocks(ops)

    def _step(self) -> list[RequestOutput]:
        # Labels for torch.profiler (kvserve doctor splits a step by them); free when it is off.
        with label("kvserve.schedule"):
            batch = self.scheduler.schedule()
        batch = self._swap(batch)
        if not batch.seqs:
            if batch.block_ops.any():
                self.runner.move_blocks(batch.block_ops)  # before the pending tokens are taken
            pending, self._pending = self._pending, None
            return [] if pending is None else self._read_pending(pending)
        pending, self._pending = self._pending, None
        self.tokens_computed += batch.num_tokens
        # A step of plain sequences (most) skips the stages that serve the others: scores,
        # evictions, beams, forks, penalties, forced tokens, logprobs.
        plain = all(map(self._is_plain, batch.seqs))
        score_from = [None] * len(batch.seqs) if plain else \
            [self._score_from(s, n) for s, n in zip(batch.seqs, batch.num_scheduled)]
        with label("kvserve.forward"):
            try:
                result = self.runner.forward(batch.seqs, batch.num_scheduled, batch.block_ops,
                                             None if plain or all(f is None for f in score_from) else score_from,
                                             pending)
            except BaseException:
                self._pending = pending  # still to be read: a later step runs the same sequences again
                raise
        logits, prompt_logits = result.logits, result.prompt_logits
        if prompt_logits.shape[0]:
            self._score_prompts(batch.seqs, batch.num_scheduled, prompt_logits)
        done = self.scheduler.complete_step(batch)  # a prompt chunk with more to come gets no token
        ready = batch.seqs
        if len(done) < len(ready):  # only then copy the logits rows that get a token
            logits, ready = self._rows(logits, done), [ready[i] for i in done]
        launched = None
        if self.async_scheduling and ready and (plain or all(map(self._is_plain, ready))):
            with label("kvserve.sample"):
                launched = PendingTokens.launch(ready, self.runner.sample(ready, logits))
        # The step before's tokens, read while this one computes: its stops and outputs first.
        outputs = [] if pending is None else self._read_pending(pending)
        self._register_blocks(batch.seqs)  # before any eviction
        if not plain:
            compactions = self._evict(batch.seqs, batch.num_scheduled, score_from, result.scores or {})
            if compactions:
                # Now, while no block the sequences gave back can have been handed out again.
                self.runner.move_blocks(BlockOps(compactions=compactions))
        if launched is not None:
            for seq in ready:  # one that the read above finished drops its sample
                if not seq.finished:
                    seq.output_token_ids.append(PLACEHOLDER)
            self._pending = launched
            return outputs
        if pending is not None and any(s.finished for s in ready):
            keep = [i for i, s in enumerate(ready) if not s.finished]
            logits, ready = self._rows(logits, keep), [ready[i] for i in keep]
        now = time.perf_counter()
        if plain:
            with label("kvserve.sample"):
                seqs, tokens = ready, self.runner.sample(ready, logits).tolist()
            logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
        else:
            outputs += self._step_beams(ready, logits, now)
            seqs, tokens, logprobs = self._sample_rows(ready, logits)
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            if logprob is not None:
                seq.output_logprobs.append(logprob)
            self._append_token(seq, token, now)
            if (out := self._emit(seq, token, now)) is not None:
                outputs.append(out)
        return outputs

    def _swap(self, batch: SchedulerOutput) -> SchedulerOutput:
        """The step's swaps, applied ahead of its other moves (their place in BlockOps' order) and
        before it is built: a sequence whose pages the disk tier failed to take or give back is
        recomputed instead, and leaves the step if it was to run in it."""
        ops = batch.block_ops
        if not (ops.swap_out or ops.swap_in):
            return batch
        lost = self.runner.move_blocks(BlockOps(swap_out=ops.swap_out, swap_in=ops.swap_in))
        rest = dataclasses.replace(ops, swap_out=(), swap_in=())
        return self.scheduler.recompute_lost(dataclasses.replace(batch, block_ops=rest), lost)

    def _register_blocks(self, seqs: list[Sequence]) -> None:
        """The blocks the step filled join the prefix cache (and the remote tier). Blocks computed
        after an eviction do not match a plain prefix; a sequence the read of its pending token
        finished has no blocks left."""
        joined: list[tuple[int, bytes]] = []
        bm = self.block_manager
        for seq in seqs:
            if not seq.finished and not seq.num_evicted and bm.has_unregistered_blocks(seq.seq_id,
                                                                                       seq.num_computed_tokens):
                joined += bm.register_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        if joined and self.remote is not None and self.remote.available:
            payloads = read_blocks(self.pool.block_tensors, [block for block, _ in joined])
            self.remote.store([(h, payload) for (_, h), payload in zip(joined, payloads)])

    def _sample_rows(self, ready: list[Sequence], logits: torch.Tensor
                     ) -> tuple[list[Sequence], list[int], list[TokenLogprobs | None]]:
        """Tokens for the sampled (not beam) sequences, forks of a finished prompt included (each
        from its parent's row), after penalties, with forced tokens and logprobs."""
        sampled = [i for i, s in enumerate(ready) if s.beam is None]
        seqs, rows = self._fork_samples([ready[i] for i in sampled])
        with label("kvserve.sample"):
            rows_logits = apply_penalties(self._rows(logits, [sampled[r] for r in rows]), [s.params for s in seqs],
                                          [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs])
            tokens = [s.params.forced_token_ids[len(s.output_token_ids)] if s.params.forced_token_ids is not None
                      else t for s, t in zip(seqs, self.runner.sample(seqs, rows_logits).tolist())]
            logprobs = token_logprobs(rows_logits, [s.params.logprobs for s in seqs],
                                      [s.params.scale_temperature for s in seqs], tokens)
        return seqs, tokens, logprobs

    @staticmethod
    def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The logits of `rows`, indexed on the device (a Python list index is copied there
        synchronously, which would stall async scheduling)."""
        if rows == list(range(logits.shape[0])):
            return logits
        return logits.index_select(0, to_device(torch.tensor(rows, dtype=torch.long), logits.device))

    @staticmethod
    def _is_plain(seq: Sequence) -> bool:
        """None of what acts on a sequence's new token on the host at once (beams and forks step
        there, penalties count the outputs, logprobs and forced tokens come with the token,
        eviction ranks the step's attention): its steps skip those stages, and with async
        scheduling its token may be read a step late."""
        p = seq.params
        return (seq.beam is None and not seq.num_forks and seq.eviction is None and not p.penalized
                and p.logprobs is None and p.forced_token_ids is None)

    def _read_pending(self, pending: PendingTokens) -> list[RequestOutput]:
        """Puts the tokens the step before sampled in place of their placeholders."""
        tokens = pending.read()
        now = time.perf_counter()
        outputs = []
        for seq, token in zip(pending.seqs, tokens):
            if seq.finished:  # aborted since, or finished when read and sampled once more
                continue
            seq.output_token_ids[-1] = token
            self._count_token(seq, now)
            if (out := self._emit(seq, token, now)) is not None:
                outputs.append(out)
        return outputs

    def _emit(self, seq: Sequence, token: int, now: float) -> RequestOutput | None:
        """A sequence's output after `token` joined it: text, stop checks, and its end if it ends
        (None: a running sequence whose caller wants its final output only)."""
        try:
            self.output_processor.append_text(seq, token)
        except Exception as err:  # a fault in one request's bookkeeping ends that request only
            logger.exception("request %s failed", seq.request_id)
            seq.finish_reason, seq.error = "error", f"{type(err).__name__}: {err}"
        if seq.finish_reason is not None:
            seq.finish_time = now
            self.scheduler.finish(seq)
            if all(s.finished for s in self._requests[seq.request_id]):
                del self._requests[seq.request_id]
        return self.output_processor.output(seq)

    @staticmethod
    def _score_from(seq: Sequence, num_scheduled: int) -> int | None:
        """The first position whose query counts toward the scores `seq`'s policy ranks by this
        step (None: none does): H2O every query, TOVA the newest (on a step that evicts), SnapKV
        those from the observation window before the prompt's end (or its chunk's) on."""
        policy = seq.eviction
        prompt = len(seq.prompt_token_ids)
        computed = seq.num_computed_tokens
        if policy is None or not policy.scored or (not policy.during_decode and computed >= prompt):
            return None
        end = computed + num_scheduled
        state = seq.kv_state
        if policy.name == "tova" and computed >= prompt and state is not None and \
                not policy.decode_due(end - state.num_evicted):
            return None  # TOVA ranks by the newest query alone: only the evicting step's matters
        stop = policy.prompt_stop(computed, prompt) if computed < prompt else prompt
        first = {"h2o": 0, "tova": end - 1, "snapkv": stop - policy.observation_window}[policy.name]
        return first if first < end else None

    def _evict(self, seqs: list[Sequence], num_scheduled: list[int], score_from: list[int | None],
               scores: dict[int, torch.Tensor]) -> tuple[Compaction, ...]:
        """Each evicting sequence's slots grow by the tokens the step computed; one whose prompt
        is computed and whose policy is due drops tokens, and the block manager compacts it.
        Returns the compactions, for the pool. One whose compaction finds no blocks for its
        copies of shared blocks would, run on un-evicted, keep other tokens than it keeps alone:
        it is recomputed, at once, so that the sequences after it see its blocks back (two that
        share a prefix and both lack blocks would otherwise be recomputed together forever).
        Beams, and a prompt about to fork its samples, wait for their next due step instead."""
        cfg = self.model_config
        ran = {s.seq_id for s in seqs}
        compactions: list[Compaction] = []
        for i, seq in enumerate(seqs):
            if seq.eviction is None:
                continue
            state = seq.kv_state or EvictionState.empty(seq.eviction, cfg.num_layers, cfg.num_kv_heads)
            end = seq.num_computed_tokens
            slots = end - state.num_evicted
            step = scores.get(i)
            counted = end - max(score_from[i] or 0, end - num_scheduled[i])  # queries scored this step
            state.grow(end, None if step is None else step[..., :slots], counted if step is not None else 0)
            seq.kv_state = state
            prompt = len(seq.prompt_token_ids)
            if not state.due(end, prompt, prompt_end=end - num_scheduled[i] < prompt <= end):
                continue
            if seq.beam is not None and any(b.seq_id not in ran for b in self._requests[seq.request_id]):
                continue  # it will recompute its last token in its slot (_step_beams): no moves now
            moves, after = state.evicted()
            compaction = self.block_manager.compact(seq.seq_id, moves.layer, moves.head, moves.src, moves.dst,
                                                    moves.kept)
            if compaction is not None:
                compactions.append(compaction)
                seq.kv_state = after
                self.evicted_tokens[seq.eviction.name] += after.num_evicted - state.num_evicted
            elif seq.beam is None and not seq.num_forks:
                self.scheduler.recompute(seq)
        return tuple(compactions)

    def _score_prompts(self, seqs: list[Sequence], num_scheduled: list[int], logits: torch.Tensor) -> None:
        """Prompt logprobs of the positions this step ran (rows in `prompt_span` order)."""
        owners, targets = [], []
        for seq, n in zip(seqs, num_scheduled):
            lo, hi = prompt_span(seq, seq.num_computed_tokens, seq.num_computed_tokens + n)
            owners += [seq] * (hi - lo)
            targets += seq.prompt_token_ids[lo + 1:hi + 1]
        scored = token_logprobs(logits, [s.params.prompt_logprobs for s in owners],
                                [s.params.scale_temperature for s in owners], targets)
        for seq, logprob in zip(owners, scored):
            seq.prompt_logprobs.append(logprob)

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        """The step computed every token but the new one."""
        seq.output_token_ids.append(token)
        self._count_token(seq, now)

    def _count_token(self, seq: Sequence, now: float) -> None:
        self.tokens_generated += 1
        seq.first_token_time = seq.first_token_time or now

    def _step_beams(self, batch: list[Sequence], logits: torch.Tensor, now: float) -> list[RequestOutput]:
        """Advances every beam-search request whose beams all ran in this step; survivors reuse
        or fork their parent's blocks, dropped beams free theirs. Returns finished requests."""
        rows = {seq.seq_id: i for i, seq in enumerate(batch)}
        outputs = []
        for request_id in dict.fromkeys(s.request_id for s in batch if s.beam is not None):
            beams = self._requests[request_id]
            group = beams[0].beam
            if any(b.seq_id not in rows for b in beams):
                # A beam was preempted: the others wait for it, recomputing their last token.
                for b in beams:
                    b.num_computed_tokens = min(b.num_computed_tokens, b.num_tokens - 1)
                continue
            logprobs = torch.log_softmax(logits[[rows[b.seq_id] for b in beams]], dim=-1)
            survivors = group.step(logprobs, [b.output_token_ids for b in beams])
            kept: dict[int, Sequence] = {}
            new_beams: list[tuple[Sequence, int]] = []
            for parent_index, token in survivors:
                parent = beams[parent_index]
                if parent_index in kept:
                    child = self._fork(parent, group.next_index(), parent.seed)
                else:
                    child = kept[parent_index] = parent
                new_beams.append((child, token))
            for i, b in enumerate(beams):
                b.num_forks = 0
                if i not in kept:
                    self.scheduler.finish(b)
            for child, token in new_beams:
                self._append_token(child, token, now)
            self._requests[request_id] = [c for c, _ in new_beams]
            if group.done:
                outputs.append(self._finish_beams(request_id, beams[0], now))
        return outputs

    def _finish_beams(self, request_id: str, first: Sequence, now: float) -> RequestOutput:
        for b in self._requests.pop(request_id):
            self.scheduler.finish(b)
        best = first.beam.best()
        result = Sequence(request_id, first.prompt_token_ids, first.params, first.seed, prompt=first.prompt,
                          output_token_ids=best.token_ids, status=SequenceStatus.FINISHED,
                          arrival_time=first.arrival_time, first_scheduled_time=first.first_scheduled_time,
                          first_token_time=first.first_token_time,
                          finish_time=now,
                          finish_reason="stop" if best.token_ids[-1] == first.beam.eos_token_id else "length")
        if self.tokenizer is not None:
            result.text = self.tokenizer.decode(best.token_ids, skip_special_tokens=True)
        return dataclasses.replace(RequestOutput.of(result, result.text, result.text), beam_score=best.score)

    def _fork(self, parent: Sequence, index: int, seed: int) -> Sequence:
        """A running copy of `parent` (same tokens and progress) sharing all of its blocks."""
        child = Sequence(parent.request_id, parent.prompt_token_ids, parent.params, seed,
                         prompt=parent.prompt, index=index, beam=parent.beam, cache_salt=parent.cache_salt,
                         eviction=parent.eviction,
                         kv_state=None if parent.kv_state is None else parent.kv_state.clone(),
                         output_token_ids=list(parent.output_token_ids),
                         output_logprobs=list(parent.output_logprobs), prompt_logprobs=list(parent.prompt_logprobs),
                         num_computed_tokens=parent.num_computed_tokens,
                         arrival_time=parent.arrival_time, first_scheduled_time=parent.first_scheduled_time,
                         first_token_time=parent.first_token_time,
                         detokenizer=self._detokenizer())  # its text starts over from every output id
        self.block_manager.fork(parent.seq_id, child.seq_id)
        self.scheduler.add_running(child)
        return child

    def _fork_samples(self, batch: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """After its prefill, a request with n samples forks n - 1 sequences that share its blocks
        and draw their first token from the same logits row. Sample i is seeded with seed + i, so
        it equals a separate request with that seed."""
        seqs, rows = list(batch), list(range(len(batch)))
        for row, parent in enumerate(batch):
            for index in range(1, parent.num_forks + 1):
                child = self._fork(parent, index, parent.seed + index)
                self._requests[parent.request_id].append(child)
                seqs.append(child)
                rows.append(row)
            parent.num_forks = 0
        return seqs, rows

    def _detokenizer(self) -> Detokenizer | None:
        return None if self.tokenizer is None else Detokenizer(self.tokenizer)

    # -- reporting --------------------------------------------------------------------------
    def kv_usage(self) -> BlockUsage:
        return self.block_manager.usage()

    def stats(self) -> dict[str, Any]:
        usage = self.kv_usage()
        return {"kv_blocks_total": usage.total, "kv_blocks_used": usage.used,
                "kv_blocks_peak": self.block_manager.peak_used, "kv_waste": usage.waste,
                "kv_blocks_cached": usage.cached, "kv_pool_bytes": self.pool.nbytes,
                "prefix_cache_hit_rate": self.block_manager.prefix_stats.hit_rate,
                "kv_evicted_tokens": dict(self.evicted_tokens),
                "kv_blocks_freed_by_eviction": self.block_manager.evicted_blocks,
                "num_preemptions": self.scheduler.num_preemptions,
                "preemptions_by_mode": dict(self.scheduler.preemptions),
                "swap_tiers": [] if self.swap is None else [vars(u) for u in self.swap.usage()],
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "swapped": len(self.scheduler.swapped)}
