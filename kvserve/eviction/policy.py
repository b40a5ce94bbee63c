"""What an evicting sequence keeps: one policy name, its budget and knobs, validated together."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.validate import FieldError, is_int

POLICY_NAMES = ("none", "window", "h2o", "snapkv", "tova", "strided")
# Policies that rank tokens by the attention they receive (the step's scores are computed for them).
SCORED = ("h2o", "snapkv", "tova")


@dataclass(frozen=True)
class EvictionPolicy:
    """`budget` tokens kept per sequence (per KV head and layer where the policy chooses per head).

    - window: the first `sink_tokens` and the most recent ones (StreamingLLM).
    - h2o: the `window` most recent, the rest by the attention they received since the prompt
      began, per query that could see them.
    - snapkv: the `observation_window` most recent, the rest by the attention of the last
      `observation_window` queries, average-pooled over `pooling_kernel` neighbours; applied when
      the prompt ends and again after every `observation_window` decoded tokens.
    - tova: by the attention of the newest query alone, one token dropped per step.
    - strided: the sinks, the `window` most recent, and among older tokens every `stride`-th
      position (the newest of them, as many as the budget leaves room for).

    During decode a sequence is brought back to `budget` once it holds `interval` tokens more
    (kvpress' DecodingPress has the same knob): with `interval` = the block size a compaction frees
    a whole block each time, as often as one token per step would, and TOVA is scored only then.

    With `prefill_chunk`, a prompt runs in chunks ending at multiples of it and is cut back to
    `budget` after each one (the policy judging what it has seen so far; SnapKV's observation
    window is the chunk's last queries), so it holds `budget + prefill_chunk` slots at most, not
    its length. The chunk ends are positions, not whatever the scheduler cut, so a sequence
    recomputed after preemption evicts at the same points. Without it the prompt is judged whole
    when it ends, as kvpress does.

    Scored policies choose per KV head, or with `mean_heads` one set per layer by the scores
    averaged over its heads (as the TOVA paper and kvpress' presses do).
    """
    name: str
    budget: int
    sink_tokens: int = 4
    window: int | None = None            # h2o / strided: recent tokens always kept (default budget // 2)
    stride: int = 4
    observation_window: int = 32
    pooling_kernel: int = 5
    during_decode: bool = True           # False: evict once, when the prompt ends (kvpress' protocol)
    mean_heads: bool = False             # scored policies: one kept set per layer, by scores averaged over heads
    interval: int = 1                    # during decode: evict once this many tokens past the budget
    prefill_chunk: int | None = None     # evict within the prompt after every this many tokens

    def __post_init__(self) -> None:
        self.check("EvictionPolicy")

    @property
    def recent(self) -> int:
        return self.budget // 2 if self.window is None else self.window

    def decode_due(self, slots: int) -> bool:
        """Whether a decoding sequence holding `slots` is cut back to the budget now."""
        return slots >= self.budget + self.interval

    def prompt_stop(self, computed: int, prompt: int) -> int:
        """Where the prompt's next run ends, from `computed` tokens: its end, or with
        `prefill_chunk` the next chunk end before it."""
        if self.prefill_chunk is None:
            return prompt
        return min(prompt, (computed // self.prefill_chunk + 1) * self.prefill_chunk)

    def chunk_ends_at(self, end: int) -> bool:
        """Whether a prompt chunk ends at position `end` (an eviction point within the prompt)."""
        return self.prefill_chunk is not None and end % self.prefill_chunk == 0

    def cacheable(self, prompt: int) -> int:
        """The most prompt tokens the prefix cache may supply without changing what this policy
        keeps: a cached position's query never runs, so its attention is never counted (H2O counts
        every prompt query, SnapKV the observation window's), and a hit past a chunk end skips that
        chunk's eviction."""
        if self.name == "h2o":
            return 0
        chunked = self.prefill_chunk is not None and self.prefill_chunk < prompt
        first_eviction = self.prefill_chunk if chunked else prompt
        if self.name == "snapkv":
            return max(first_eviction - self.observation_window, 0)
        # A step must end at a chunk end for it to evict there (the prompt's end always does).
        return first_eviction - 1 if chunked else first_eviction

    @property
    def scored(self) -> bool:
        return self.name in SCORED

    def check(self, owner: str) -> None:
        """Raises ValueError naming `owner`.field for the first invalid setting."""
        if self.name not in POLICY_NAMES:
            raise FieldError("kv_eviction",
                             f"{owner}.kv_eviction must be one of {', '.join(POLICY_NAMES)}, got {self.name!r}")
        for name in ("budget", "stride", "observation_window", "pooling_kernel"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise FieldError(f"kv_{name}", f"{owner}.kv_{name} must be a positive integer, got {value!r}")
        if not is_int(self.interval) or self.interval < 1:
            raise FieldError("kv_evict_interval",
                             f"{owner}.kv_evict_interval must be a positive integer, got {self.interval!r}")
        if self.prefill_chunk is not None and (not is_int(self.prefill_chunk) or self.prefill_chunk < 1):
            raise FieldError("kv_prefill_chunk",
                             f"{owner}.kv_prefill_chunk must be a positive integer or None, got {self.prefill_chunk!r}")
        if self.name == "snapkv" and self.prefill_chunk is not None and self.prefill_chunk < self.observation_window:
            raise FieldError("kv_prefill_chunk",
                             f"{owner}.kv_prefill_chunk ({self.prefill_chunk}) must be at least "
                             f"kv_observation_window ({self.observation_window}) for snapkv: its chunk's last "
                             f"queries rank the tokens")
        for name, field in (("during_decode", "kv_evict_during_decode"), ("mean_heads", "kv_mean_heads")):
            if not isinstance(getattr(self, name), bool):
                raise FieldError(field, f"{owner}.{field} must be True or False, got {getattr(self, name)!r}")
        if not is_int(self.sink_tokens) or self.sink_tokens < 0:
            raise FieldError("kv_sink_tokens",
                             f"{owner}.kv_sink_tokens must be an integer >= 0, got {self.sink_tokens!r}")
        if self.window is not None and (not is_int(self.window) or self.window < 0):
            raise FieldError("kv_window", f"{owner}.kv_window must be an integer >= 0 or None, got {self.window!r}")
        if self.pooling_kernel % 2 == 0:
            raise FieldError("kv_pooling_kernel",
                             f"{owner}.kv_pooling_kernel must be odd (pooling keeps positions centred), "
                             f"got {self.pooling_kernel}")
        reserved = {"window": self.sink_tokens, "strided": self.sink_tokens + self.recent, "h2o": self.recent,
                    "snapkv": self.observation_window}.get(self.name, 0)
        if self.name != "none" and self.budget <= reserved:
            what = {"window": "kv_sink_tokens", "strided": "kv_sink_tokens + kv_window", "h2o": "kv_window",
                    "snapkv": "kv_observation_window"}[self.name]
            raise FieldError("kv_budget",
                             f"{owner}.kv_budget ({self.budget}) must exceed {what} ({reserved}) for "
                             f"kv_eviction={self.name!r}")

