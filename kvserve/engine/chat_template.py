"""Chat messages into prompt token ids through the tokenizer's chat template: one path for
`LLM.chat`, `kvserve generate` / `chat` and the server's /v1/chat/completions."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvserve.validate import FieldError, check_utf8

ROLES = ("system", "user", "assistant")


def check_messages(messages: Any, name: str = "messages") -> list[dict[str, str]]:
    """A conversation as a list of {"role", "content"} dicts of text; FieldError naming the field."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise FieldError(name, f"{name}: must be a non-empty list of {{'role': ..., 'content': ...}} messages")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise FieldError(f"{name}.{i}",
                             f"{name}.{i}: must be a dict with 'role' and 'content', got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise FieldError(f"{name}.{i}.role", f"{name}.{i}.role: must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise FieldError(f"{name}.{i}.content",
                             f"{name}.{i}.content: must be a string, got {type(content).__name__}")
        check_utf8(f"{name}.{i}.content", content)
        checked.append({"role": role, "content": content})
    return checked


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The prompt the model's chat template makes of `messages` (checked by check_messages), as ids."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise FieldError("messages", "messages: this model has no chat template; send a plain prompt instead")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                         **dict(chat_template_kwargs or {}))
    return tokenizer.encode(text)
