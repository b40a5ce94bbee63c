"""Prometheus metrics of one server, in a registry of its own (no process-global state)."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.sequence import RequestOutput

# Seconds; from one decode step of a small model on CPU to a long request.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Seconds of one engine step: a decode step of a small model on CPU to a long prefill chunk.
_STEP_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5)
# A step's kind: "decode" when it ran one token per sequence and sampled each (its cost is the
# weights' read and attention), "prefill" when it also ran prompt chunks or draft tokens.
STEP_KINDS = ("decode", "prefill")


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.kv_blocks_used = Gauge("kvserve_kv_blocks_used", "KV blocks owned by a sequence", registry=r)
        self.kv_blocks_free = Gauge("kvserve_kv_blocks_free",
                                    "KV blocks not owned (cached ones included)", registry=r)
        self.kv_blocks_cached = Gauge("kvserve_kv_blocks_cached",
                                      "free KV blocks that keep a reusable prefix", registry=r)
        self.kv_usage = Gauge("kvserve_kv_usage_ratio", "fraction of KV blocks in use", registry=r)
        self.kv_group_blocks = Gauge("kvserve_kv_group_blocks", "KV blocks held per KV cache group (hybrid models "
                                     "have a full group and sliding-window groups)", ["group", "kind"], registry=r)
        self.prefix_hit_rate = Gauge("kvserve_prefix_cache_hit_rate",
                                     "fraction of prompt tokens found in the prefix cache", registry=r)
        self.requests = Gauge("kvserve_requests", "sequences by scheduler state", ["state"], registry=r)
        self.preemptions = Counter("kvserve_preemptions", "sequences preempted", ["mode"], registry=r)
        self.evicted_tokens = Counter("kvserve_kv_evicted_tokens", "tokens dropped from sequences' KV by eviction",
                                      ["policy"], registry=r)
        self.evicted_blocks = Counter("kvserve_kv_blocks_freed_by_eviction",
                                      "KV blocks returned to the pool by compaction after eviction", registry=r)
        self.prompt_tokens = Counter("kvserve_prompt_tokens", "prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("kvserve_generation_tokens", "tokens generated", registry=r)
        self.finished = Counter("kvserve_request_finished", "finished sequences by reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("kvserve_request_rejected", "requests refused before queueing",
                                ["reason"], registry=r)
        self.ttft = Histogram("kvserve_time_to_first_token_seconds", "arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvserve_time_per_output_token_seconds",
                              "mean time between output tokens of a sequence", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.e2e = Histogram("kvserve_e2e_request_latency_seconds", "arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("kvserve_request_queue_time_seconds", "arrival to first scheduled",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.engine_info = Gauge("kvserve_engine_info", "the engine's kernel choices (value 1)",
                                 ["attention_backend", "linear", "chunked_prefill", "async_scheduling"], registry=r)
        self.remote = Counter("kvserve_kv_remote_blocks", "the KV tier below the prefix cache (kv_remote or "
                              "kv_disk_dir) by event: lookups, hits, stored, corrupt (failed check: flipped, "
                              "truncated or foreign), errors (failed calls, a full disk), bytes_read, bytes_written",
                              ["event"], registry=r)
        self.spec_decode = Counter("kvserve_spec_decode_tokens", "speculative decoding: drafts verified, draft "
                                   "tokens proposed, and of those accepted", ["event"], registry=r)
        self.spec_accepted = Counter("kvserve_spec_decode_drafts_by_accepted_length", "verified drafts by how many "
                                     "of their tokens were accepted", ["accepted"], registry=r)
        self.step_seconds = Histogram("kvserve_engine_step_seconds", "wall time of one engine step, by kind: decode "
                                      "(one token per sequence, each sampled) or prefill (prompt chunks or draft "
                                      "tokens ran too)", ["kind"], buckets=_STEP_BUCKETS, registry=r)
        self.step_tokens = Counter("kvserve_engine_step_tokens", "tokens computed by engine steps, by kind",
                                   ["kind"], registry=r)
        self._seen_spec: dict[str, int] = {}
        self._seen_spec_lengths: dict[str, int] = {}
        self._seen_remote: dict[str, int] = {}
        self._seen_preemptions: dict[str, int] = {}
        self._seen_evicted: dict[str, int] = {}
        self._seen_generated = 0
        self._seen_computed = 0
        self._seen_evicted_blocks = 0

    def observe_step_cost(self, engine: LLMEngine, seconds: float, outputs: int) -> None:
        """The step just run: `seconds` of wall time, `outputs` sequences' tokens read."""
        tokens = engine.tokens_computed - self._seen_computed
        self._seen_computed = engine.tokens_computed
        kind = "decode" if tokens == outputs else "prefill"
        self.step_seconds.labels(kind=kind).observe(seconds)
        self.step_tokens.labels(kind=kind).inc(tokens)

    def observe_step(self, engine: LLMEngine) -> None:
        """Counters that the engine keeps as running totals; cheap enough for every step."""
        _catch_up(self.preemptions, "mode", engine.scheduler.preemptions, self._seen_preemptions)
        _catch_up(self.evicted_tokens, "policy", engine.evicted_tokens, self._seen_evicted)
        if engine.remote is not None:
            _catch_up(self.remote, "event", dataclasses.asdict(engine.remote.stats), self._seen_remote)
        spec = engine.update.verifier.stats
        _catch_up(self.spec_decode, "event", {"drafts": spec.drafts, "draft_tokens": spec.draft_tokens,
                                              "accepted_tokens": spec.accepted_tokens}, self._seen_spec)
        _catch_up(self.spec_accepted, "accepted", {str(k): n for k, n in spec.accepted_lengths.items()},
                  self._seen_spec_lengths)
        freed = engine.block_manager.evicted_blocks
        self.evicted_blocks.inc(freed - self._seen_evicted_blocks)
        self._seen_evicted_blocks = freed
        self.generation_tokens.inc(engine.tokens_generated - self._seen_generated)
        self._seen_generated = engine.tokens_generated

    def observe_finished(self, out: RequestOutput) -> None:
        self.finished.labels(finish_reason=out.finish_reason).inc()
        if out.finish_time is None:
            return
        self.e2e.observe(out.finish_time - out.arrival_time)
        if out.first_scheduled_time is not None:
            self.queue_time.observe(out.first_scheduled_time - out.arrival_time)
        if out.first_token_time is not None:
            self.ttft.observe(out.first_token_time - out.arrival_time)
            if len(out.token_ids) > 1:
                self.tpot.observe((out.finish_time - out.first_token_time) / (len(out.token_ids) - 1))

    def observe_gauges(self, engine: LLMEngine) -> None:
        """The KV pool and queues; walks the block tables, so it runs per scrape, not per step."""
        usage = engine.kv_usage()
        self.kv_blocks_used.set(usage.used)
        self.kv_blocks_free.set(usage.free + usage.cached)
        self.kv_blocks_cached.set(usage.cached)
        for group, (kind, held) in enumerate(zip(engine.kv_groups.kinds(), engine.block_manager.group_blocks())):
            self.kv_group_blocks.labels(group=str(group), kind=kind).set(held)
        self.kv_usage.set(usage.used / usage.total)
        self.prefix_hit_rate.set(engine.block_manager.prefix_stats.hit_rate)
        self.engine_info.labels(attention_backend=engine.attention_backend.name,
                                linear=engine.runner.linear_kind or "torch",
                                chunked_prefill=str(engine.scheduler.chunked_prefill).lower(),
                                async_scheduling=str(engine.async_scheduling).lower()).set(1)
        sched = engine.scheduler
        for state, seqs in (("running", sched.running), ("waiting", sched.waiting), ("swapped", sched.swapped)):
            self.requests.labels(state=state).set(len(seqs))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _catch_up(counter: Counter, label: str, totals: Mapping[str, int], seen: dict[str, int]) -> None:
    """Advance a labelled counter to the engine's running totals (`seen`: what it last reported)."""
    for value, total in totals.items():
        counter.labels(**{label: value}).inc(total - seen.get(value, 0))
        seen[value] = total
