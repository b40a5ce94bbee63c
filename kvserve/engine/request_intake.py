"""A request checked and turned into a `Sequence` before it touches engine state, so that a bad
one is refused with an error naming what the caller passed and never disturbs the others."""
from __future__ import annotations

import itertools
import numbers
import random
from collections.abc import Iterable
from typing import Any

import numpy as np

from kvserve.cache.block_manager import BlockManager
from kvserve.config import EngineConfig
from kvserve.engine.beam_search import BeamGroup
from kvserve.engine.detokenizer import Detokenizer
from kvserve.engine.sequence import OutputState, Sequence
from kvserve.engine.spec_state import SpecState
from kvserve.eviction.policy import EvictionPolicy
from kvserve.model.config import ModelConfig
from kvserve.sampling_params import SamplingParams
from kvserve.validate import FieldError, check_utf8


class RequestIntake:
    def __init__(self, config: EngineConfig, tokenizer: Any, model_config: ModelConfig, max_model_len: int,
                 block_manager: BlockManager, eos_token_id: int | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.windowed = bool(model_config.sliding_layers)
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.block_manager = block_manager
        self._ids = itertools.count()
        self._rng = random.Random(config.model.seed)

    def encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise FieldError("prompt", "prompt: this model has no tokenizer; pass token ids")
            check_utf8("prompt", prompt)
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, Iterable) or isinstance(prompt, (bytes, bytearray)):
            # bytes would pass as token ids (its items are ints): the caller meant text
            raise FieldError("prompt", f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}")
        ids = list(prompt)
        # numpy / torch integers are fine; floats and bools (an int to Python) are not token ids.
        # Plain ints are let through first: asking the ABC about every id took ~1 ms for a
        # 512-token prompt.
        if any(type(t) is not int and (not isinstance(t, numbers.Integral) or isinstance(t, (bool, np.bool_)))
               for t in ids):
            raise FieldError("prompt", "prompt: token ids must be integers")
        return None, [int(t) for t in ids]

    def detokenizer(self) -> Detokenizer | None:
        return None if self.tokenizer is None else Detokenizer(self.tokenizer)

    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None, cache_salt: str | None = None) -> Sequence:
        """`cache_salt`: prefix-cache hits only among requests carrying the same salt (a tenant's)."""
        if cache_salt is not None:
            if not isinstance(cache_salt, str) or not cache_salt:
                raise FieldError("cache_salt", "cache_salt: must be a non-empty string")
            check_utf8("cache_salt", cache_salt)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise FieldError("params", f"params: must be SamplingParams, got {type(params).__name__}")
        text, ids = self.encode(prompt)
        if not ids:
            raise FieldError("prompt", "prompt: empty prompt")
        self._check_ids(ids, params)
        self._check_room(len(ids), params)
        eviction = self.config.eviction_policy(params.kv_eviction, params.kv_budget, owner="SamplingParams")
        if eviction is not None and (reason := self.config.eviction_unsupported()):
            raise FieldError("kv_eviction", f"kv_eviction: {reason}")
        if eviction is not None and self.windowed:
            raise FieldError("kv_eviction", "kv_eviction: this model has sliding-window layers, and eviction on "
                             "them is not built")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        beam = None
        if params.beam_width > 1:
            beam = BeamGroup(params.beam_width, params.length_penalty, params.early_stopping,
                             params.max_tokens, None if params.ignore_eos else self.eos_token_id)
        return Sequence(request_id or str(next(self._ids)), ids, params, seed, prompt=text,
                        num_forks=max(params.n, params.beam_width) - 1, beam=beam, cache_salt=cache_salt,
                        eviction=eviction, spec=self._spec_state(params, beam, eviction),
                        # The first prompt token has no context to score it.
                        out=OutputState(self.detokenizer(),
                                        prompt_logprobs=[] if params.prompt_logprobs is None else [None]))

    def _spec_state(self, params: SamplingParams, beam: BeamGroup | None,
                    eviction: EvictionPolicy | None) -> SpecState | None:
        """A request speculates when the engine does, unless a token's consequences on the host
        come with it one at a time (beams, eviction, penalties, logprobs, forced tokens): those
        requests decode as usual beside the speculating ones."""
        if self.config.speculative.speculative is None or beam is not None or eviction is not None or \
                params.penalized or params.logprobs is not None or params.forced_token_ids is not None:
            return None
        return SpecState()

    def _check_ids(self, ids: list[int], params: SamplingParams) -> None:
        vocab = self.vocab_size
        for name, listed in (("prompt", ids), ("forced_token_ids", params.forced_token_ids),
                             ("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            if listed and any(not 0 <= t < vocab for t in listed):
                raise FieldError(name, f"{name}: token ids must be in [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            if (k := getattr(params, name)) is not None and k > vocab:
                raise FieldError(name, f"{name}: {k} exceeds the vocabulary ({vocab} tokens); -1 returns all")

    def _check_room(self, num_prompt: int, params: SamplingParams) -> None:
        """The prompt and its outputs fit the context and the KV cache; samples and beams fit the
        batch, and beams (run together, never offloaded) the device pool."""
        limit = self.max_model_len
        if num_prompt >= limit:
            raise FieldError("prompt",
                             f"prompt: {num_prompt} prompt tokens leave no room to generate within the "
                             f"context length max_model_len={limit}")
        total = num_prompt + params.max_tokens
        if total > limit:
            raise FieldError("max_tokens",
                             f"max_tokens: {num_prompt} prompt tokens + max_tokens {params.max_tokens} exceed "
                             f"the context length max_model_len={limit}")
        # In blocks: a hybrid model's sliding groups hold their window, not the whole sequence.
        bm = self.block_manager
        pool = f"{bm.capacity} blocks of {bm.block_size} tokens"
        if bm.blocks_peak(num_prompt) > bm.capacity:
            raise FieldError("prompt",
                             f"prompt: {num_prompt} tokens exceed the device KV pool ({pool}); raise kv_cache_memory")
        if bm.blocks_peak(total) > bm.capacity + bm.num_host_blocks:
            raise FieldError("prompt",
                             f"prompt: {num_prompt} prompt tokens + max_tokens {params.max_tokens} exceed "
                             f"the whole KV cache ({pool}, {bm.num_host_blocks} host blocks); raise kv_cache_memory")
        max_num_seqs = self.config.scheduler.max_num_seqs
        if params.n > max_num_seqs:
            raise FieldError("n", f"n: {params.n} samples exceed max_num_seqs={max_num_seqs}")
        if params.beam_width > 1 and params.beam_width * bm.blocks_peak(total) > bm.capacity:
            raise FieldError("beam_width",
                             f"beam_width: {params.beam_width} beams of up to {total} tokens must fit the "
                             f"device KV pool together ({pool})")
        if params.beam_width > max_num_seqs:
            raise FieldError("beam_width", f"beam_width: {params.beam_width} beams exceed max_num_seqs={max_num_seqs}")
