"""A sequence's output text, a token at a time, emitting only whole characters."""
from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream


class Detokenizer:
    """One per sequence. Where the tokenizer has a `tokenizers` (Rust) backend, its DecodeStream
    keeps the state: ~1 us a token, where decoding a window of ids twice per token (the text
    before and after the new one, the way without it) took ~8 us with the bundled tokenizer, a
    share of every step's host time at large batches. A sequence whose stream fails goes on in
    the window."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None if self._backend is None else DecodeStream(skip_special_tokens=True)
        self._fed = 0  # ids the stream has been given (a fork starts at 0 and catches up)
        self._whole = 0  # ids whose text the stream has emitted whole
        # Without a stream: the text of ids[prefix:read] has been emitted.
        self._prefix = self._read = 0

    def step(self, ids: list[int]) -> str:
        """The text that `ids` (the output so far) add since the last call. A byte-level token
        may end inside a UTF-8 sequence: its text waits for the tokens that complete it."""
        if self._stream is not None:
            parts: list[str] = []
            try:
                for t in ids[self._fed:]:
                    part = self._stream.step(self._backend, t)
                    self._fed += 1
                    if part is not None:  # the text through this token is out, whole
                        parts.append(part)
                        self._whole = self._fed
            except Exception:  # tokenizers raises a bare Exception
                # The stream refuses some decoders' output midway ("Invalid prefix encountered":
                # byte fallback with a Strip, as Llama's and Mistral's tokenizers have); the window
                # takes over from the last token whose text came out whole.
                self._stream = None
                self._prefix, self._read = max(self._whole - 1, 0), self._whole
                return "".join(parts) + self.step(ids)
            return "".join(parts)
        prefix = self.tokenizer.decode(ids[self._prefix:self._read], skip_special_tokens=True)
        full = self.tokenizer.decode(ids[self._prefix:], skip_special_tokens=True)
        if full.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(ids)
        return full[len(prefix):]
