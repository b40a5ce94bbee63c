"""A request as the engine tracks it: its tokens and progress (`Sequence`, written by the
scheduler and by the step's update as tokens join it), and what the caller is shown of it
(`OutputState`, written by the output side alone: text, logprobs, how and when it ended)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvserve.engine.beam_search import BeamGroup
from kvserve.engine.detokenizer import Detokenizer
from kvserve.engine.spec_state import SpecState
from kvserve.eviction.policy import EvictionPolicy
from kvserve.eviction.state import EvictionState
from kvserve.sampling_params import SamplingParams


# An output token sampled on the device whose value the host has not read yet (async scheduling,
# engine/pending_tokens.py): the last output of a sequence between two steps, never in an output.
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenLogprobs:
    """One output position under the distribution its token was drawn from (see
    `SamplingParams.logprobs`)."""
    token_id: int
    logprob: float
    top: dict[int, float]       # the `logprobs` most likely tokens, most likely first
    full: torch.Tensor | None   # [vocab] fp32 log-probabilities, when logprobs == -1


@dataclass(eq=False)
class OutputState:
    """A sequence's output as its caller sees it. The scheduler reads none of it: a sequence ends
    for the scheduler by its status (`Sequence.finished`), set when `finish_reason` is."""
    detokenizer: Detokenizer | None = None  # None: no tokenizer, no text
    text: str = ""
    text_sent: int = 0  # characters of `text` its outputs have shown
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)  # with params.logprobs
    # With params.prompt_logprobs: one per prompt token scored so far, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    first_token_time: float | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    error: str | None = None          # what went wrong, when finish_reason is "error"
    finish_time: float | None = None


# Compared by identity: the scheduler finds a sequence in its queues with `in` and `remove`, where
# comparing every field would cost a scan of its token lists, and two sequences with equal fields
# (a request re-sent under its id) are still two.
@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    prompt: str | None = None
    index: int = 0        # which of the request's n samples this is
    num_forks: int = 0    # sequences still to fork from this one once its prompt is prefilled
    beam: BeamGroup | None = None  # shared by the beams of a beam-search request
    cache_salt: str | None = None  # prefix-cache hits only among requests with the same salt
    eviction: EvictionPolicy | None = None  # which tokens its cache keeps (None: all)
    kv_state: EvictionState | None = None   # with `eviction`, once its first tokens are computed
    spec: SpecState | None = None  # it drafts tokens to verify (speculative decoding; None: it never does)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0   # tokens whose K/V are in the pool
    num_preemptions: int = 0
    num_cached_tokens: int | None = None  # prompt tokens its first admission found cached, any tier
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None  # queue time ends here
    out: OutputState = field(default_factory=OutputState)

    # Unique per sample; the block manager's key. Asked several times per sequence per step: a
    # field, not a property.
    seq_id: str = field(init=False)

    def __post_init__(self) -> None:
        self.seq_id = self.request_id if self.index == 0 else f"{self.request_id}#{self.index}"

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without joining the prompt and output lists: a decode step reads
        one token of thousands."""
        prompt = len(self.prompt_token_ids)
        if start >= prompt:
            return self.output_token_ids[start - prompt:end - prompt]
        if end <= prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_evicted(self) -> int:
        return 0 if self.kv_state is None else self.kv_state.num_evicted

    @property
    def num_slots(self) -> int:
        """KV slots the sequence needs for all its tokens: its tokens less those evicted."""
        return self.num_tokens - self.num_evicted

    @property
    def num_new_tokens(self) -> int:
        """Tokens this step must run through the model."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_runnable(self) -> int:
        """Tokens it may run this step: all it has not computed, except that an evicting sequence
        recomputing its outputs (after preemption) runs them one per step, so that its evictions
        replay exactly as they first happened, and a prompt evicted chunk by chunk runs up to its
        next chunk end."""
        if self.eviction is None:
            return self.num_new_tokens
        prompt = len(self.prompt_token_ids)
        if self.num_tokens - self.num_computed_tokens == 1:
            return self.num_new_tokens
        if self.num_computed_tokens < prompt:
            return self.eviction.prompt_stop(self.num_computed_tokens, prompt) - self.num_computed_tokens
        return 1

    @property
    def num_slots_to_run(self) -> int:
        """KV slots it must hold to run its `num_runnable` tokens (fewer than `num_slots` while an
        evicting sequence still has tokens it may not run yet)."""
        if self.eviction is None:  # all of its tokens: asked of every running sequence every step
            return len(self.prompt_token_ids) + len(self.output_token_ids)
        return self.num_computed_tokens + self.num_runnable - self.num_evicted

    @property
    def awaiting_length_finish(self) -> bool:
        """Its pending token is its last (max_tokens): it finishes when that token is read, so it
        runs no further step (only async scheduling leaves a sequence here; beams end by their
        group)."""
        return self.beam is None and len(self.output_token_ids) >= self.params.max_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass
class RequestOutput:
    request_id: str
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None
    error: str | None
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int
    logprobs: list[TokenLogprobs] | None  # one per token of token_ids, when asked for
    prompt_logprobs: list[TokenLogprobs | None] | None  # one per prompt token (None for the first)
    beam_score: float | None = None  # beam search: the hypothesis' sum of log-probs / length ** penalty
    num_cached_tokens: int = 0  # prompt tokens served from a cache (device, host or remote tier)

    @classmethod
    def of(cls, seq: Sequence, text: str, delta_text: str) -> "RequestOutput":
        """`text`: what the output shows of `seq.out.text` (a running one holds back a stop
        string's possible start)."""
        out = seq.out
        return cls(seq.request_id, seq.index, seq.prompt, seq.prompt_token_ids, text,
                   list(seq.output_token_ids), delta_text, seq.finished, out.finish_reason,
                   out.error, seq.arrival_time, seq.first_scheduled_time, out.first_token_time, out.finish_time,
                   seq.num_preemptions,
                   None if seq.params.logprobs is None else list(out.output_logprobs),
                   None if seq.params.prompt_logprobs is None else list(out.prompt_logprobs),
                   num_cached_tokens=seq.num_cached_tokens or 0)
