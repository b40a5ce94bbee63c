"""The eviction part of the configuration: the engine's token-eviction policy and the knobs every
policy reads (kvserve.eviction); a request may pick another policy or budget."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.config.options import Options, opt
from kvserve.eviction.policy import POLICY_NAMES, EvictionPolicy
from kvserve.validate import FieldError


@dataclass(frozen=True)
class EvictionOptions(Options):
    kv_eviction: str = opt("none", "drop cached tokens once a sequence holds kv_budget: window (sinks + recent, "
                                   "StreamingLLM), h2o (heavy hitters), snapkv (scored by the prompt's last "
                                   "queries), tova (lowest attention of the newest query), strided (every "
                                   "kv_stride-th old token); none keeps all", choices=POLICY_NAMES)
    kv_budget: int | None = opt(None, "tokens each sequence keeps per KV head with kv_eviction (required with it); "
                                      "with kv_eviction none, the budget of requests that pick a policy and no "
                                      "budget of their own")
    kv_sink_tokens: int = opt(4, "first tokens window and strided always keep")
    kv_window: int | None = opt(None, "recent tokens h2o and strided always keep (default kv_budget // 2)")
    kv_stride: int = opt(4, "strided keeps old tokens at positions divisible by this")
    kv_observation_window: int = opt(32, "snapkv: queries whose attention ranks tokens (and recent tokens kept)")
    kv_pooling_kernel: int = opt(5, "snapkv: positions its scores are averaged over (odd)")
    kv_evict_during_decode: bool = opt(True, "keep each sequence at kv_budget at every step (off: evict once, "
                                             "when the prompt ends, as kvpress does, and let the cache grow)")
    kv_evict_interval: int | None = opt(None, "during decode, evict once a sequence holds this many tokens past "
                                              "kv_budget (default block_size: a block freed per compaction; 1: "
                                              "every step)")
    kv_prefill_chunk: int | None = opt(None, "evict within prompts: run them this many tokens at a time and cut "
                                             "back to kv_budget after each chunk, so a long prompt holds "
                                             "kv_budget + this many slots, not its length (default: a prompt is "
                                             "judged whole when it ends, as kvpress does)")
    kv_mean_heads: bool = opt(False, "h2o, snapkv, tova: keep one set of tokens per layer, ranked by attention "
                                     "averaged over its heads (TOVA's paper, kvpress), not one set per KV head")

    def _check(self) -> None:
        self._one_of("kv_eviction", POLICY_NAMES)
        self._positive("kv_budget")
        # Knobs are checked whenever set, though only a policy reads them: a request may pick one.
        self._policy("EvictionOptions", "none", 1, block_size=1)
        self.policy(None, None, "EvictionOptions", block_size=1)

    def policy(self, name: str | None, budget: int | None, owner: str, block_size: int) -> EvictionPolicy | None:
        """The engine's policy with a request's overrides (errors name `owner`'s field); None for no
        eviction. `block_size`: the default interval, a block freed per compaction."""
        name = self.kv_eviction if name is None else name
        if name == "none":
            if budget is not None:  # a request's budget alone would be ignored without a word
                raise FieldError("kv_budget", f"{owner}.kv_budget has no effect without kv_eviction (this one: 'none')")
            return None
        budget = self.kv_budget if budget is None else budget
        if budget is None:
            raise FieldError("kv_budget", f"{owner}.kv_budget is required with kv_eviction={name!r}")
        return self._policy(owner, name, budget, block_size)

    def _policy(self, owner: str, name: str, budget: int, block_size: int) -> EvictionPolicy:
        """`name` at `budget` with these knobs."""
        try:
            return EvictionPolicy(
                name=name, budget=budget, sink_tokens=self.kv_sink_tokens, window=self.kv_window,
                stride=self.kv_stride, observation_window=self.kv_observation_window,
                pooling_kernel=self.kv_pooling_kernel, during_decode=self.kv_evict_during_decode,
                mean_heads=self.kv_mean_heads, prefill_chunk=self.kv_prefill_chunk,
                interval=block_size if self.kv_evict_interval is None else self.kv_evict_interval)
        except FieldError as err:
            raise FieldError(err.field, str(err).replace("EvictionPolicy.", f"{owner}.", 1)) from None
