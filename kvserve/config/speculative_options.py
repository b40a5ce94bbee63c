"""The speculative decoding part of the configuration, in vLLM's names: which proposer drafts
tokens for the target model to verify in one step, how many, and when speculation stands down."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.config.options import Options, opt
from kvserve.validate import FieldError

SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeOptions(Options):
    speculative: str | None = opt(None, "draft tokens to verify in one step: ngram (prompt lookup: what followed "
                                        "the last earlier occurrence of the sequence's trailing n-gram, in its "
                                        "prompt or output); greedy and seeded outputs are unchanged",
                                  choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = opt(4, "the most draft tokens a sequence verifies per step")
    prompt_lookup_min: int = opt(2, "ngram: the shortest trailing n-gram looked up")
    prompt_lookup_max: int = opt(4, "ngram: the longest trailing n-gram looked up (the longest that occurs wins)")
    speculative_disable_by_batch_size: int = opt(
        4, "no drafts in a step that decodes this many sequences or more: a bigger batch is compute-bound on a "
           "CPU, where a draft's verification is no longer nearly free")

    def _check(self) -> None:
        if self.speculative is not None:
            self._one_of("speculative", SPECULATIVE_METHODS)
        self._positive("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                       "speculative_disable_by_batch_size")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise FieldError("prompt_lookup_min", f"SpeculativeOptions.prompt_lookup_min ({self.prompt_lookup_min}) "
                                                  f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")
