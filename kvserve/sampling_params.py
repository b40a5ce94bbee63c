"""Per-request decoding settings, validated on construction."""
from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property

from kvserve.eviction.policy import POLICY_NAMES
from kvserve.validate import FieldError, check_utf8, is_int

OUTPUT_KINDS = ("cumulative", "final")
GREEDY_BELOW = 1e-5
# Stop strings are searched at every token of every sample, and a running output holds back the
# longest one's length - 1 characters: unbounded, one request's stops slowed every other request.
# OpenAI's API takes 4; evaluation harnesses send a few more.
MAX_STOPS = 16
MAX_STOP_CHARS = 128


@dataclass
class SamplingParams:
    max_tokens: int = 16
    n: int = 1                  # samples per prompt; they share the prompt's KV blocks
    temperature: float = 1.0    # 0 (anything below 1e-5) means greedy
    top_k: int = 0              # 0 disables
    top_p: float = 1.0
    # Sample i of n uses seed + i. The random draw depends on (seed, position) alone, so in fp32
    # a seeded request gives the same tokens in any batch. In bf16 it may not: the logits
    # themselves move slightly with the batch (the matmuls block and sum differently), and a
    # near-tie can flip after some tokens. Run fp32 where batch-invariance matters.
    seed: int | None = None
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
    # The same for every prompt token after the first (what `echo` scores); the prompt is then
    # computed in full, never taken from the prefix cache.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0    # OpenAI's: -2..2, over the tokens generated so far
    frequency_penalty: float = 0.0   # OpenAI's: -2..2, per appearance in the output so far
    repetition_penalty: float = 1.0  # HF's: > 0, over prompt and output; 1 disables
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (-100..100)
    # Teacher forcing: the output is these tokens instead of sampled ones, each still decoded in
    # its own cached step (with `logprobs`, scores a continuation under the engine's KV cache).
    forced_token_ids: list[int] | None = None
    # Token eviction for this request (kvserve.eviction), overriding the engine's kv_eviction
    # and kv_budget; "none" keeps every token. The engine's other eviction knobs apply.
    kv_eviction: str | None = None
    kv_budget: int | None = None
    # "cumulative": an output every step (text and tokens so far, and the new text); "final": the
    # finished output only (LLM.generate's, and a non-streaming request's: vLLM's FINAL_ONLY), which
    # spares the host an output object per sequence per step.
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("max_tokens", "n", "beam_width"):
            if not is_int(getattr(self, name)) or getattr(self, name) <= 0:
                raise FieldError(name, f"SamplingParams.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.beam_width > 1 and self.n > 1:
            raise FieldError("n", "SamplingParams.n must be 1 with beam search (beam_width > 1)")
        for name in ("temperature", "top_p", "length_penalty", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not _is_number(getattr(self, name)):
                raise FieldError(name, f"SamplingParams.{name} must be a finite number, got {getattr(self, name)!r}")
        if self.temperature < 0:
            raise FieldError("temperature", f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise FieldError("top_k", f"SamplingParams.top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise FieldError(name, f"SamplingParams.{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise FieldError("repetition_penalty",
                             f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logit_bias is not None and (
                not isinstance(self.logit_bias, dict) or not _are_token_ids(self.logit_bias)
                or any(not _is_number(b) or not -100 <= b <= 100 for b in self.logit_bias.values())):
            raise FieldError("logit_bias",
                             "SamplingParams.logit_bias must map token ids (integers >= 0) to biases in [-100, 100]")
        if self.logit_bias is not None:  # floats: an integer bias made a Long tensor the step could not add
            self.logit_bias = {token: float(bias) for token, bias in self.logit_bias.items()}
        if self.beam_width > 1 and self.penalized:
            raise FieldError("beam_width",
                             "SamplingParams.beam_width: penalties and logit_bias are not supported with beam search")
        if self.beam_width > 1 and (self.stop or self.stop_token_ids):
            # Hypotheses end on EOS or length only (HF num_beams): a stop would be ignored.
            raise FieldError("beam_width",
                             "SamplingParams.beam_width: stop and stop_token_ids are not supported with beam search")
        if not 0 < self.top_p <= 1:
            raise FieldError("top_p", f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not is_int(self.seed):
            raise FieldError("seed", f"SamplingParams.seed must be an integer or None, got {self.seed!r}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise FieldError("stop", "SamplingParams.stop must be a list of non-empty strings")
        if len(self.stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise FieldError("stop",
                             f"SamplingParams.stop: at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} "
                             f"characters each; got {len(self.stop)}, the longest of {max(map(len, self.stop))}")
        for stop in self.stop:
            check_utf8("SamplingParams.stop", stop)  # no decoded text holds a lone surrogate
        if not isinstance(self.stop_token_ids, list) or not _are_token_ids(self.stop_token_ids):
            raise FieldError("stop_token_ids",
                             "SamplingParams.stop_token_ids must be a list of token ids (integers >= 0)")
        for name in ("ignore_eos", "early_stopping"):
            if not isinstance(getattr(self, name), bool):
                raise FieldError(name, f"SamplingParams.{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < -1):
                raise FieldError(name,
                                 f"SamplingParams.{name} must be None, -1 (all) or an integer >= 0, got {value!r}")
            if value is not None and self.beam_width > 1:
                raise FieldError(name, f"SamplingParams.{name} is not supported with beam search (beam_width > 1)")
        if self.forced_token_ids is not None:
            forced = self.forced_token_ids
            if not isinstance(forced, list) or not _are_token_ids(forced):
                raise FieldError("forced_token_ids",
                                 "SamplingParams.forced_token_ids must be a list of token ids (integers >= 0)")
            if len(forced) < self.max_tokens:
                raise FieldError("forced_token_ids",
                                 f"SamplingParams.forced_token_ids holds {len(forced)} tokens, fewer than "
                                 f"max_tokens ({self.max_tokens})")
            if self.n > 1 or self.beam_width > 1:
                raise FieldError("forced_token_ids", "SamplingParams.forced_token_ids needs n == 1 and beam_width == 1")

        if self.kv_eviction is not None and self.kv_eviction not in POLICY_NAMES:
            raise FieldError("kv_eviction",
                             f"SamplingParams.kv_eviction must be one of {', '.join(POLICY_NAMES)}, "
                             f"got {self.kv_eviction!r}")
        if self.kv_budget is not None and (not is_int(self.kv_budget) or self.kv_budget < 1):
            raise FieldError("kv_budget",
                             f"SamplingParams.kv_budget must be a positive integer, got {self.kv_budget!r}")
        if self.output_kind not in OUTPUT_KINDS:
            raise FieldError("output_kind",
                             f"SamplingParams.output_kind must be one of {', '.join(OUTPUT_KINDS)}, "
                             f"got {self.output_kind!r}")

    @property
    def greedy(self) -> bool:
        # vLLM's threshold: below it, logits / temperature overflows fp32 (or the temperature
        # itself rounds to 0 there) and the distribution is a one-hot of the argmax anyway.
        return self.temperature < GREEDY_BELOW

    @property
    def scale_temperature(self) -> float:
        """What the logits are divided by for sampling and log-probabilities (greedy counts as 1)."""
        return 1.0 if self.greedy else self.temperature

    @cached_property
    def stop_hold(self) -> int:
        """Characters of new text a running output holds back: all but the last of the longest
        stop string, which the next tokens may complete (and the output must not show)."""
        return max(map(len, self.stop), default=1) - 1

    @cached_property
    def stop_pattern(self) -> re.Pattern[str]:
        """Every stop string in one alternation: one search finds the earliest (its leftmost match)."""
        return re.compile("|".join(map(re.escape, self.stop)))

    @property
    def penalized(self) -> bool:
        """Whether a penalty or a logit bias changes the logits this request samples from."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias)



def _is_number(value: object) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _are_token_ids(values: Iterable[object]) -> bool:
    return all(is_int(t) and t >= 0 for t in values)  # type: ignore[operator]
