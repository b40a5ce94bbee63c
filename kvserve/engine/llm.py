"""The offline entry point: `LLM(...).generate(prompts, params)` and streaming.

One call at a time per `LLM`: each steps the engine and keeps only its own outputs, so a second
one open at once is refused; a call that ends early (an exception, a stream closed) aborts its
requests, returning their blocks. Concurrent clients go through `kvserve serve`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence as Seq
from typing import Any

from tqdm import tqdm

from kvserve.config import EngineConfig
from kvserve.engine.chat_template import chat_prompt_ids, check_messages
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.sequence import RequestOutput
from kvserve.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: Any = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig.of(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def _add_all(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None,
                 cache_salt: str | None = None, final_only: bool = False) -> dict[str, int]:
        """Queues the prompts; returns each request id with its number of samples, in order.
        `final_only`: the engine reports each sample once, finished (SamplingParams.output_kind)."""
        if self.engine.has_unfinished():
            # Each call steps the engine and keeps only its own outputs: a second one open at the
            # same time would take the first one's outputs, and that one would wait forever.
            raise RuntimeError("LLM: another generate() or stream() of this LLM is still running; finish or "
                               "close it first (for concurrent requests, serve them: kvserve serve)")
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                         and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        elif isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
            # bytes would pass as token ids (its items are ints): the caller meant text
            raise ValueError(f"prompts: must be a string, a list of token ids, or a list of those; "
                             f"got {type(prompts).__name__}")
        prompts = list(prompts)  # a generator too
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        elif not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"params: must be SamplingParams or a list of them, got {type(params).__name__}")
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} SamplingParams for {len(prompts)} prompts")
        if final_only:
            params = [dataclasses.replace(p, output_kind="final") for p in params]
        # Validate every request before queueing any: a bad one rejects the call, not half of it.
        seqs = [self.engine.make_sequence(p, sp, cache_salt=cache_salt) for p, sp in zip(prompts, params)]
        return {self.engine.add_sequence(seq): seq.params.n for seq in seqs}

    def generate(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, cache_salt: str | None = None) -> list[RequestOutput]:
        """One output per prompt, in order; a prompt with n > 1 samples gives n, by sample index.
        `cache_salt`: prefix-cache hits only among requests carrying the same salt."""
        requests = self._add_all(prompts, params, cache_salt, final_only=True)
        done: dict[tuple[str, int], RequestOutput] = {}
        try:
            with tqdm(total=sum(requests.values()), desc="generating", unit="seq", disable=not use_tqdm) as bar:
                while self.engine.has_unfinished():
                    for out in self.engine.step():
                        if out.finished:
                            done[out.request_id, out.index] = out
                            bar.update(1)
        finally:
            # After an error or Ctrl-C, requests left running would be run first by the next call.
            for request_id in requests:
                self.engine.abort(request_id)
        return [done[rid, i] for rid, n in requests.items() for i in range(n)]

    def chat(self, messages: Seq[Mapping[str, str]] | Seq[Seq[Mapping[str, str]]],
             params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template_kwargs: Mapping[str, Any] | None = None,
             cache_salt: str | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} messages) or a list of
        them, each rendered by the model's chat template and generated as `generate` does."""
        single = isinstance(messages, Seq) and bool(messages) and isinstance(messages[0], Mapping)
        conversations = [messages] if single else messages
        if isinstance(conversations, (str, bytes)) or not isinstance(conversations, Seq) or not conversations:
            raise ValueError("messages: must be a conversation (a list of {'role': ..., 'content': ...}) or a "
                             "list of conversations")
        prompts: list[Prompt] = [
            chat_prompt_ids(self.tokenizer, check_messages(c, "messages" if single else f"messages.{i}"),
                            add_generation_prompt, chat_template_kwargs)
            for i, c in enumerate(conversations)]
        return self.generate(prompts, params, use_tqdm=use_tqdm, cache_salt=cache_salt)

    def stream(self, prompts: Prompt | Seq[Prompt],
               params: SamplingParams | Seq[SamplingParams] | None = None,
               cache_salt: str | None = None) -> Iterator[RequestOutput]:
        """Yields each sample's output as it grows; `delta_text` holds the new text."""
        pending = self._add_all(prompts, params, cache_salt)  # samples still running per request
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending[out.request_id] -= 1
                            if not pending[out.request_id]:
                                del pending[out.request_id]
                        yield out
        finally:
            for request_id in pending:  # the consumer stopped early
                self.engine.abort(request_id)
