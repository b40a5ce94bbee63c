"""The engine's face: takes requests, runs steps (schedule -> execute -> update), reports.

`engine_parts.build_engine_parts` builds the pieces from the config; `RequestIntake` checks a
request before it touches them; a step is the scheduler's plan (`SchedulerOutput`), the runner's
forward pass over it, and `StepUpdate`, which applies the result on the host.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from kvserve.cache.block_manager import BlockUsage
from kvserve.cache.block_ops import BlockOps
from kvserve.config import EngineConfig
from kvserve.engine.engine_parts import build_engine_parts
from kvserve.engine.eviction_step import EvictionStep
from kvserve.engine.forks import Forks
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.request_intake import RequestIntake
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.engine.sequence import PLACEHOLDER, RequestOutput, Sequence
from kvserve.engine.pending_tokens import PendingTokens
from kvserve.engine.step_plan import StepPlan, plan_step
from kvserve.engine.step_update import StepUpdate
from kvserve.engine.token_counter import TokenCounter
from kvserve.profiling import label
from kvserve.sampling_params import SamplingParams
from kvserve.validate import FieldError


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        parts = build_engine_parts(config)
        self.config = config
        self.device = parts.device
        self.model, self.model_config, self.model_name = parts.model, parts.model_config, parts.model_name
        self.tokenizer, self.eos_token_id = parts.tokenizer, parts.eos_token_id
        self.max_model_len = parts.max_model_len
        self.kv_bytes_per_token, self.kv_groups = parts.kv_bytes_per_token, parts.kv_groups
        self.pool, self.remote, self.swap = parts.pool, parts.remote, parts.swap
        self.block_manager, self.scheduler = parts.block_manager, parts.scheduler
        self.attention_backend, self.runner, self.tp = parts.attention_backend, parts.runner, parts.tp
        self.async_scheduling = parts.async_scheduling
        self.kv_events = parts.kv_events
        self.intake = RequestIntake(config, parts.tokenizer, parts.model_config, parts.max_model_len,
                                    parts.block_manager, parts.eos_token_id)
        self.counter = TokenCounter()
        self.update = StepUpdate(
            parts.scheduler, parts.runner, parts.block_manager, parts.pool, parts.remote,
            Forks(parts.block_manager, parts.scheduler, parts.tokenizer, self.intake.detokenizer, self.counter),
            EvictionStep(parts.block_manager, parts.scheduler, parts.model_config), self.counter,
            OutputProcessor(parts.eos_token_id, parts.max_model_len), parts.async_scheduling)

    @property
    def tokens_computed(self) -> int:
        return self.counter.computed

    @property
    def tokens_generated(self) -> int:
        return self.counter.generated

    @property
    def evicted_tokens(self) -> dict[str, int]:
        return self.update.eviction.evicted_tokens

    def fatal_error(self) -> str | None:
        """Why this engine can run no further step (a tensor-parallel rank died), or None."""
        if self.tp is not None:
            dead = self.tp.dead_workers(grace_s=1.0)  # asked after a failed step: waiting is cheap
            if dead:
                return f"tensor-parallel rank(s) {', '.join(dead)} died; the engine cannot continue"
        return None

    def close(self) -> None:
        """Stops the tensor-parallel workers and the KV event publisher, and gives up the tier below
        the prefix cache, if any (an engine without them holds no process, socket or directory)."""
        if self.tp is not None:
            self.tp.close()
        if self.remote is not None:
            self.remote.close()
        if self.kv_events is not None:
            self._publish_events()
            self.kv_events.close()

    # -- requests ---------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return self.intake.encode(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None) -> str:
        return self.add_sequence(self.make_sequence(prompt, params, request_id, cache_salt))

    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None, cache_salt: str | None = None) -> Sequence:
        """Validates a request without touching engine state, so a bad one never disturbs others."""
        return self.intake.make_sequence(prompt, params, request_id, cache_salt)

    def add_sequence(self, seq: Sequence) -> str:
        requests = self.update.requests
        if seq.request_id in requests:
            raise FieldError("request_id", f"request_id: {seq.request_id!r} is already in use")
        requests[seq.request_id] = [seq]
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: str) -> None:
        """Ends every sample of the request and returns their blocks."""
        for seq in self.update.requests.pop(request_id, []):
            if seq.output_token_ids[-1:] == [PLACEHOLDER]:  # its token is still on the device: dropped
                seq.output_token_ids.pop()
            if not seq.finished:
                seq.out.finish_reason = "abort"
                seq.out.finish_time = time.perf_counter()
                self.scheduler.finish(seq)
        self._settle()
        self._publish_events()

    def is_active(self, request_id: str) -> bool:
        """Whether the request still has samples queued or running."""
        return request_id in self.update.requests

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def request_state_left(self) -> list[str]:
        """What the engine itself still holds of requests (idle_check)."""
        requests = self.update.requests
        return ([f"requests {sorted(requests)[:8]}"] if requests else []) + (
            ["a step's sampled tokens never read"] if self.update.pending is not None else [])

    # -- stepping ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward pass. Returns an output for every sequence whose new token the host read:
        this step's, and with async scheduling the step before's, read while this one runs."""
        # Labels for torch.profiler (kvserve doctor splits a step by them); free when it is off.
        with label("kvserve.schedule"):
            batch = self._swap(self.scheduler.schedule())
        pending, self.update.pending = self.update.pending, None
        if not batch.seqs:
            if batch.block_ops.any():
                self.runner.move_blocks(batch.block_ops)  # before the pending tokens are read
            outputs = self.update.read(pending)
        else:
            scores = self.update.scores(batch)
            self.counter.computed += batch.num_tokens
            with label("kvserve.forward"):
                try:
                    result = self.runner.forward(self._plan(batch, scores.score_from, pending))
                except BaseException:
                    self.update.pending = pending  # still to be read: a later step runs the same sequences again
                    raise
            outputs = self.update.apply(batch, scores, result, pending)
        self._settle()
        self._publish_events()
        return outputs

    def _publish_events(self) -> None:
        """What joined and left the prefix cache and the tier below it since the last call, as one
        batch (cache/kv_events.py)."""
        if self.kv_events is None:
            return
        events = self.block_manager.pool.take_events()
        if self.remote is not None and self.remote.events is not None:
            events += self.remote.events.take()
        if events:
            self.kv_events.publish(events)

    def _plan(self, batch: SchedulerOutput, score_from: list[int | None] | None,
              pending: PendingTokens | None) -> StepPlan:
        try:
            return plan_step(batch, self.block_manager, self.pool, self.device, score_from, pending)
        except BaseException:
            # The scheduler counts on its moves once made (blocks loaded from the remote tier are
            # in the prefix cache; swaps came before): they happen even if the step cannot run.
            self.runner.move_blocks(batch.block_ops)
            raise

    def _swap(self, batch: SchedulerOutput) -> SchedulerOutput:
        """The step's swaps, applied ahead of its other moves (their place in BlockOps' order) and
        before it is built: a sequence whose pages the disk tier failed to take or give back is
        recomputed instead, and leaves the step if it was to run in it."""
        ops = batch.block_ops
        if not (ops.swap_out or ops.swap_in):
            return batch
        # Compactions first, as BlockOps orders them: they read blocks a swap may reuse.
        lost = self.runner.move_blocks(BlockOps(compactions=ops.compactions, swap_out=ops.swap_out,
                                                swap_in=ops.swap_in))
        rest = dataclasses.replace(ops, compactions=(), swap_out=(), swap_in=())
        return self.scheduler.recompute_lost(dataclasses.replace(batch, block_ops=rest), lost)

    def _settle(self) -> None:
        """What finished or aborted sequences leave, given back now, so that an idle engine holds
        nothing of them (engine/idle_check.py): in-flight tokens of sequences that all finished
        (async scheduling: the step after a sequence's last token was launched before its stop
        was read), the staging slots of blocks they gave back (a cached one sealed first), and
        compactions carried for a next step that an engine with no request will not run."""
        pending = self.update.pending
        if pending is not None and all(s.finished for s in pending.seqs):
            self.update.pending = None
        staging = self.block_manager.staging
        if staging is not None and (seals := staging.release_unowned()):
            self.runner.move_blocks(BlockOps(seals=seals))
        if not self.scheduler.has_unfinished() and (carried := self.scheduler.take_carried()).any():
            self.runner.move_blocks(carried)  # no next step to carry them

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
                "swapped": len(self.scheduler.swapped),
                "spec_decode": self.update.verifier.stats.summary()}
