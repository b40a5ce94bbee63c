"""The OpenAI request bodies we accept, and how they become `SamplingParams`."""
from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvserve.sampling_params import SamplingParams
from kvserve.validate import FieldError


class _Strict(BaseModel):
    """Strict types, as OpenAI checks them: pydantic would otherwise take `max_tokens: true` as 1,
    `"5"` as 5 and `stream: "no"` as False (a float field still takes an integer). Two things
    clients send are taken first, as OpenAI and vLLM take them: null for a field with a default
    (OpenAI's spec marks them nullable) means that default, and a whole float for an integer
    field (a limit computed in floats, `256.0`) is that integer."""
    # A field not declared here is refused, never ignored: a misspelt option ("temprature") or one
    # the engine does not do would otherwise be answered with an ordinary sample. Fields of
    # OpenAI's API that change no output are declared, each saying why it is taken.
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _nulls_and_whole_floats(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name, field in cls.model_fields.items():
            if name not in data:
                continue
            kinds = typing.get_args(field.annotation) or (field.annotation,)
            value = data[name]
            if value is None and type(None) not in kinds and not field.is_required():
                del data[name]
            elif isinstance(value, float) and value.is_integer() and int in kinds:
                data[name] = int(value)
        return data


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):

    model: str | None = None
    n: int = 1
    temperature: float = Field(1.0, ge=0, le=2)  # OpenAI's range
    top_p: float = 1.0
    top_k: int = 0  # not OpenAI's; vLLM's extension, -1 or 0 disables
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension (HF semantics)
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias
    ignore_eos: bool = False  # vLLM's extension, for load tests of fixed length
    cache_salt: str | None = None  # vLLM's extension: prefix-cache hits only within one salt (tenant)
    kv_eviction: str | None = None  # ours: token eviction policy for this request (EngineConfig.kv_eviction)
    kv_budget: int | None = None    # ours: tokens its KV cache keeps per head with kv_eviction
    min_tokens: int = 0  # vLLM's extension: refused unless 0 (see `unsupported`)
    user: str | None = None  # OpenAI's end-user id for its abuse monitoring: changes no output, ignored

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for a request asking for something the engine does not do: answering it
        as if the field were absent would hand back something the client did not ask for."""
        if self.min_tokens:
            return "min_tokens", "min_tokens: not supported (use ignore_eos for a fixed length)"
        return None

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) for SamplingParams: how many top alternatives per token."""
        return None, None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        # ASCII digits only: int() also reads " 1", "+1", "1_0" and "٣" (an Arabic-Indic three).
        if self.logit_bias is not None and not all(k.isascii() and k.isdigit() for k in self.logit_bias):
            raise FieldError("logit_bias", "logit_bias: keys must be token ids written in ASCII digits")
        bias = None if self.logit_bias is None else {int(k): v for k, v in self.logit_bias.items()}
        logprobs, prompt_logprobs = self.logprob_counts()
        return SamplingParams(max_tokens=max_tokens, n=self.n, temperature=self.temperature,
                              top_p=self.top_p, top_k=max(self.top_k, 0), seed=self.seed,
                              stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                              ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                              logit_bias=bias, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              kv_eviction=self.kv_eviction, kv_budget=self.kv_budget,
                              output_kind="cumulative" if self.stream else "final")


# OpenAI's limits: completions' logprobs up to 5 (we allow vLLM's 20), chat's top_logprobs up to 20.
MAX_TOP_LOGPROBS = 20


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False  # the prompt's text (and its logprobs) before the completion's
    best_of: int | None = None  # refused unless it asks for nothing more than n
    suffix: str | None = None   # refused unless empty: no insertion mode

    def unsupported(self) -> tuple[str, str] | None:
        if self.best_of not in (None, self.n):
            return "best_of", "best_of: not supported (n samples are returned as drawn, none ranked)"
        if self.suffix:
            return "suffix", "suffix: not supported (no insertion mode)"
        return super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    @property
    def score_only(self) -> bool:
        """`echo` with max_tokens 0: score the prompt, generate nothing (lm-eval's way)."""
        return self.echo and self.max_tokens == 0

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[Any] | None = None  # refused unless empty: the chat template would drop them

    def unsupported(self) -> tuple[str, str] | None:
        """(its field, why) when the model cannot read this message, or None."""
        if self.tool_calls:
            return "tool_calls", "tool calls in the history are not supported; this model reads text"
        # An assistant turn may carry no text; any other turn without it would be rendered as an
        # empty message the client never meant.
        if self.content is None:
            return None if self.role == "assistant" else ("content", f"a {self.role} message needs content")
        if isinstance(self.content, str):
            return None
        for part in self.content:
            if "type" not in part:
                return "content", "a content part needs a `type` (this model reads type 'text')"
            if part.get("type") != "text":
                return "content", f"content parts of type {part.get('type')!r} are not supported; this model reads text"
            if not isinstance(part.get("text"), str):
                return "content", "a text content part needs a string `text`"
        return None

    def text(self) -> str:
        """The message as the chat template takes it, once `unsupported` found nothing."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part["text"] for part in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    # None: up to the end of the context, as vLLM does.
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Refused unless they ask for nothing (see `unsupported`): accepting them silently would
    # answer a tool call or a JSON schema with free text.
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None  # the deprecated form of tools
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None  # refused unless ["text"]
    audio: dict[str, Any] | None = None  # refused: no audio output
    prediction: dict[str, Any] | None = None  # refused: no predicted-output decoding
    store: bool = False  # refused when true: no completion is stored
    # Ignored, changing no output: tags for stored completions (none are), the successor of `user`,
    # and how to run tool calls (tools are refused).
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        for name in ("tools", "functions"):
            if getattr(self, name):
                return name, f"{name}: tool calling is not supported"
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                return name, f"{name}: tool calling is not supported"
        if self.response_format is not None and self.response_format.get("type") != "text":
            return "response_format", (f"response_format: only type 'text' is supported, got "
                                       f"{self.response_format.get('type')!r}")
        if self.modalities not in (None, ["text"]):
            return "modalities", f"modalities: only ['text'] is supported, got {self.modalities!r}"
        for name in ("audio", "prediction"):
            if getattr(self, name) is not None:
                return name, f"{name}: not supported"
        if self.store:
            return "store", "store: completions are not stored by this server"
        for i, message in enumerate(self.messages):
            if (bad := message.unsupported()) is not None:
                return f"messages.{i}.{bad[0]}", f"messages.{i}.{bad[0]}: {bad[1]}"
        return super().unsupported()

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None


def error_body(message: str, param: str | None = None, type_: str = "invalid_request_error",
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, which its clients parse into exceptions."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def field_of(err: ValueError) -> str | None:
    """The request field an engine validation error names (the OpenAI error's `param`)."""
    return err.field if isinstance(err, FieldError) else None
