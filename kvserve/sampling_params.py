"""Per-request decoding settings, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_tokens: int = 16
    n: int = 1                  # samples per prompt; they share the prompt's KV blocks
    temperature: float = 1.0    # 0 means greedy
    top_k: int = 0              # 0 disables
    top_p: float = 1.0
    seed: int | None = None     # same seed, same output, whatever else is in the batch;
                                # sample i of n uses seed + i
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    beam_width: int = 1         # > 1: deterministic beam search, HF `num_beams` semantics
    length_penalty: float = 1.0  # beam score = sum of log-probs / length ** length_penalty
    early_stopping: bool = False  # beam search stops once `beam_width` hypotheses finished
    # Per output token, its log-probability and the `logprobs` most likely tokens' (-1: the whole
    # vocabulary as a tensor), under the distribution it was drawn from: softmax(logits /
    # temperature), temperature 0 counting as 1, before top-k / top-p truncation.
    logprobs: int | None = None
    # Teacher forcing: the output is these tokens instead of sampled ones, each still decoded in
    # its own cached step (with `logprobs`, scores a continuation under the engine's KV cache).
    forced_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"SamplingParams.max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be a positive integer, got {self.n!r}")
        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool) or self.beam_width < 1:
            raise ValueError(f"SamplingParams.beam_width must be a positive integer, got {self.beam_width!r}")
        if self.beam_width > 1 and self.n > 1:
            raise ValueError("SamplingParams.n must be 1 with beam search (beam_width > 1)")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 disables), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("SamplingParams.stop must not contain empty strings")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or self.logprobs < -1):
            raise ValueError(f"SamplingParams.logprobs must be None, -1 (all) or an integer >= 0, got {self.logprobs!r}")
        if self.logprobs is not None and self.beam_width > 1:
            raise ValueError("SamplingParams.logprobs is not supported with beam search (beam_width > 1)")
        if self.forced_token_ids is not None:
            forced = self.forced_token_ids
            if not isinstance(forced, list) or any(not isinstance(t, int) or isinstance(t, bool) or t < 0
                                                   for t in forced):
                raise ValueError("SamplingParams.forced_token_ids must be a list of token ids (integers >= 0)")
            if len(forced) < self.max_tokens:
                raise ValueError(f"SamplingParams.forced_token_ids holds {len(forced)} tokens, fewer than "
                                 f"max_tokens ({self.max_tokens})")
            if self.n > 1 or self.beam_width > 1:
                raise ValueError("SamplingParams.forced_token_ids needs n == 1 and beam_width == 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
