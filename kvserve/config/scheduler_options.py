"""The scheduler part of the configuration: batch limits, chunked prefill, preemption, and async
scheduling."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.config.options import Options, opt

PREEMPTION_MODES = ("recompute", "swap", "auto")
ASYNC_SCHEDULING = ("auto", "on", "off")
# Tokens per step when chunked prefill is on and max_num_batched_tokens is not set, by device: on
# a CPU a step's time grows with its tokens, so a small one keeps running streams moving; a GPU
# runs 8192 tokens (vLLM's default) in about the time of a few hundred, and a small budget would
# leave it idle.
CHUNKED_BATCHED_TOKENS = {"cpu": 512, "cuda": 8192}


@dataclass(frozen=True)
class SchedulerOptions(Options):
    max_num_seqs: int = opt(32, "sequences per batch")
    max_num_batched_tokens: int | None = opt(
        None, "tokens per step (default with chunked prefill: 512 on a CPU, 8192 on CUDA; without: "
              "max(max_model_len, 2048))")
    enable_chunked_prefill: bool = opt(
        True, "cut prompts into chunks that run beside the decodes of running sequences, in one token "
              "budget per step (off: prefill whole prompts in steps of their own)")
    preemption_mode: str = opt("recompute", "when blocks run out: recompute, swap, or auto (the cheaper)",
                               choices=PREEMPTION_MODES)
    async_scheduling: str = opt("auto", "launch each step before reading the tokens of the one before, so the "
                                        "host's bookkeeping (stop checks, detokenizing, scheduling) runs while "
                                        "the device computes; auto: on for CUDA, off on a CPU (where the host "
                                        "and the model share the cores); requests with beams, n > 1, logprobs, "
                                        "penalties, logit_bias, forced tokens or eviction step synchronously",
                                choices=ASYNC_SCHEDULING)

    def _check(self) -> None:
        self._positive("max_num_seqs")
        self._positive("max_num_batched_tokens")
        self._one_of("preemption_mode", PREEMPTION_MODES)
        self._one_of("async_scheduling", ASYNC_SCHEDULING)
