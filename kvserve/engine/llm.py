"""The offline entry point: `LLM(...).generate(prompts, params)` and streaming."""
from __future__ import annotations

from collections.abc import Iterator, Sequence as Seq
from typing import Any

from tqdm import tqdm

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.sequence import RequestOutput
from kvserve.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: Any = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def _add_all(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] | None) -> list[str]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} SamplingParams for {len(prompts)} prompts")
        # Validate every request before queueing any: a bad one rejects the call, not half of it.
        seqs = [self.engine.make_sequence(p, sp) for p, sp in zip(prompts, params)]
        return [self.engine.add_sequence(seq) for seq in seqs]

    def generate(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        ids = self._add_all(prompts, params)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]

    def stream(self, prompts: Prompt | Seq[Prompt],
               params: SamplingParams | Seq[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Yields each request's output as it grows; `delta_text` holds the new text."""
        ids = set(self._add_all(prompts, params))
        try:
            while ids:
                for out in self.engine.step():
                    if out.request_id in ids:
                        if out.finished:
                            ids.discard(out.request_id)
                        yield out
        finally:
            for request_id in ids:  # the consumer stopped early
                self.engine.abort(request_id)
