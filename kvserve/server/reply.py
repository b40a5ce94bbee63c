"""`Reply`: what the HTTP app answers one request with, whole or chunk by chunk (server/app.py)."""
from __future__ import annotations

import time
from typing import Any

from kvserve.engine.sequence import RequestOutput
from kvserve.server.async_engine import Done, Draining
from kvserve.server.rendering import Rendering, TextOffsets


class Reply:
    """Collects one HTTP request's outputs (one engine request per prompt, n samples each) into
    OpenAI's response and chunk shapes."""

    def __init__(self, request_id: str, model: str, chat: bool, engine_ids: list[str], n: int,
                 rendering: Rendering) -> None:
        self.id, self.model, self.chat, self.n, self.rendering = request_id, model, chat, n, rendering
        self.sent: dict[int, int] = {}  # per choice, output tokens whose logprobs were streamed
        self.offsets: dict[int, TextOffsets] = {}  # per choice, the text offsets of the tokens streamed
        self.created = int(time.time())
        self.prompt_index = {rid: i for i, rid in enumerate(engine_ids)}
        self.pending = set(engine_ids)
        self.num_choices = len(engine_ids) * n
        self.finals: dict[int, RequestOutput] = {}
        # Per choice, its tokens so far: a request cut short (its replica died) still used them.
        self.completion_tokens: dict[int, int] = {}
        self.prompt_tokens: dict[str, int] = {}
        self.cached_tokens: dict[str, int] = {}  # per prompt, its tokens served from a cache
        self.error: str | None = None
        self.shutdown = False  # the error is the server shutting down, not a fault

    def error_status(self) -> tuple[int, str]:
        """The HTTP status and OpenAI error type of `error`: a shutdown is no fault of the server's."""
        return (503, "service_unavailable") if self.shutdown else (500, "internal_error")

    def take(self, item: Any) -> None:
        if isinstance(item, Done):
            self.pending.discard(item.request_id)
        elif isinstance(item, Exception):
            self.error = str(item)
            self.shutdown = isinstance(item, Draining)
        else:
            self.prompt_tokens[item.request_id] = len(item.prompt_token_ids)
            self.cached_tokens[item.request_id] = item.num_cached_tokens
            if item.finish_reason == "error":
                self.error = f"internal error in request {item.request_id}: {item.error}"
                return
            self.completion_tokens[self.index(item)] = len(item.token_ids)
            if item.finished:
                self.finals[self.index(item)] = item

    def index(self, out: RequestOutput) -> int:
        return self.prompt_index[out.request_id] * self.n + out.index

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage, with the prompt tokens a cache served (any tier) in its details."""
        prompt = sum(self.prompt_tokens.values())
        completion = 0 if self.rendering.score_only else sum(self.completion_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())}}

    def chunk_base(self) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model}

    def chunk(self, index: int, delta: dict[str, Any] | str, finish_reason: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": finish_reason}
        choice["delta" if self.chat else "text"] = delta
        return {**self.chunk_base(), "choices": [choice]}

    def has_new_logprobs(self, out: RequestOutput) -> bool:
        return out.logprobs is not None and len(out.logprobs) > self.sent.get(self.index(out), 0)

    def chunk_of(self, out: RequestOutput) -> dict[str, Any]:
        index = self.index(out)
        first = index not in self.sent
        start = self.sent.get(index, 0)
        r = self.rendering
        # The prompt goes out with the choice's first chunk; scoring a prompt sends no completion.
        text = (r.prompt_text(out) if first and r.echo else "") + ("" if r.score_only else out.delta_text)
        chunk = self.chunk(index, {"content": text} if self.chat else text,
                           out.finish_reason if out.finished else None)
        if out.logprobs is not None:
            entries = r.entries(out, start, first and r.echo)
            if self.chat:
                chunk["choices"][0]["logprobs"] = r.chat_logprobs(entries)
            else:
                if index not in self.offsets:
                    self.offsets[index] = r.output_offsets(out)
                offsets = r.offsets(out, start, first and r.echo, self.offsets[index])
                chunk["choices"][0]["logprobs"] = r.completion_logprobs(entries, offsets)
        self.sent[index] = len(out.logprobs or [])
        return chunk

    def body(self) -> dict[str, Any]:
        choices = []
        for index in range(self.num_choices):
            out = self.finals.get(index)
            r = self.rendering
            text = r.text(out) if out else ""
            choice: dict[str, Any] = {"index": index, "logprobs": None,
                                      "finish_reason": out.finish_reason if out else "abort"}
            if out is not None and out.logprobs is not None:
                entries = r.entries(out, 0, r.echo)
                choice["logprobs"] = (r.chat_logprobs(entries) if self.chat else
                                      r.completion_logprobs(entries, r.offsets(out, 0, r.echo, r.output_offsets(out))))
            if out is not None and r.score_only:
                choice["finish_reason"] = "length"
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}
