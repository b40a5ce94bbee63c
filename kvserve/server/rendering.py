"""How engine outputs become OpenAI's text and logprobs: token strings and bytes, text offsets,
and completions' echo."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenizers.decoders import ByteLevel

from kvserve.engine.detokenizer import Detokenizer
from kvserve.engine.sequence import RequestOutput, TokenLogprobs


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet inverted: the character each byte is written as in a
    token's piece -> that byte. Printable Latin-1 bytes stand for themselves; the other 68 are
    written as U+0100 onwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(rest)}}


_BYTE_OF = _byte_level_alphabet()


def _byte_level(tokenizer: Any) -> Any | None:
    """The `tokenizers` backend of a byte-level BPE tokenizer (GPT-2's pieces), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(getattr(backend, "decoder", None), ByteLevel) else None


def token_bytes_of(tokenizer: Any, token_text: Callable[[int], str]) -> Callable[[int], bytes]:
    """A token's own UTF-8 bytes, as OpenAI's chat logprobs give them. A byte-level BPE token may
    hold part of a character (an emoji is often three tokens), whose text alone is U+FFFD: its
    bytes come from its piece. Added tokens (<|im_end|>) are stored as plain text, and other
    tokenizers' tokens are their text."""
    if _byte_level(tokenizer) is None:
        return lambda token: token_text(token).encode()
    added = set(tokenizer.added_tokens_decoder)

    def token_bytes(token: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token)
        if token in added or piece is None:  # None: an id past the tokenizer's vocabulary
            return token_text(token).encode()
        return bytes(_BYTE_OF[c] for c in piece)
    return token_bytes


def longest_token_bytes(tokenizer: Any) -> int | None:
    """The most UTF-8 bytes one token of a byte-level BPE tokenizer without a normalizer covers,
    so that a text of B bytes is at least B / that many tokens: a prompt can be refused as too long
    before tokenizing it (4 MiB takes seconds). None where no such bound holds (another kind of
    tokenizer, or a normalizer that may shrink the text first)."""
    backend = _byte_level(tokenizer)
    if backend is None or backend.normalizer is not None:
        return None
    added = (len(t.content.encode()) for t in tokenizer.added_tokens_decoder.values())
    return max(*added, *(len(piece) for piece in tokenizer.get_vocab()))


class TextOffsets:
    """Where each token of a list starts in the text the list decodes to, a token at a time: the
    length of the whole characters the tokens before it decode to. A byte-level token may hold
    part of a character: it starts where that character starts, as does the token completing it.
    Through the engine's own `Detokenizer` (~1 us a token, the text an output shows), where
    decoding every prefix would cost the square of the length."""

    def __init__(self, tokenizer: Any, shown: Callable[[int], str], chars: int = 0) -> None:
        """`shown`: the text a token adds that the detokenizer leaves out (it skips special
        tokens, as outputs do; an echoed prompt shows them). `chars`: where the first token starts."""
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.shown, self.chars = shown, chars
        self.ids: list[int] = []

    def take(self, ids: list[int]) -> list[int]:
        """The offsets of `ids`, the tokens that follow those taken before."""
        offsets = []
        for token in ids:
            offsets.append(self.chars)
            self.ids.append(token)
            if self.detokenizer is not None:
                self.chars += len(self.detokenizer.step(self.ids))
            self.chars += len(self.shown(token))
        return offsets


@dataclass(frozen=True)
class Rendering:
    """How outputs become OpenAI text and logprobs: token strings and bytes, and completions' echo."""
    tokenizer: Any  # None: a model without one, whose tokens are shown as their ids
    token_text: Callable[[int], str]
    token_bytes: Callable[[int], bytes]
    echo: bool = False
    score_only: bool = False  # echo with max_tokens 0: the prompt alone, its one engine token dropped

    def prompt_text(self, out: RequestOutput) -> str:
        # The server submits token ids, so the output holds no prompt text. The ids are decoded
        # together: a character split over tokens is U+FFFD in each token's text alone.
        if self.tokenizer is None:
            return "".join(map(self.token_text, out.prompt_token_ids))
        return self.tokenizer.decode(out.prompt_token_ids)

    def text(self, out: RequestOutput) -> str:
        return (self.prompt_text(out) if self.echo else "") + ("" if self.score_only else out.text)

    def entries(self, out: RequestOutput, start: int, echo: bool) -> list[tuple[int, TokenLogprobs | None]]:
        """(token, its logprobs) from output token `start` on, the prompt's first when `echo`."""
        head = list(zip(out.prompt_token_ids, out.prompt_logprobs or [])) if echo else []
        tail = [] if self.score_only else list(zip(out.token_ids[start:], (out.logprobs or [])[start:]))
        return head + tail

    def output_offsets(self, out: RequestOutput) -> TextOffsets:
        """The text offsets of a choice's output tokens, which start after the echoed prompt."""
        return TextOffsets(self.tokenizer, lambda _: "", len(self.prompt_text(out)) if self.echo else 0)

    def offsets(self, out: RequestOutput, start: int, echo: bool, outputs: TextOffsets) -> list[int]:
        """The text offsets of `entries(out, start, echo)`; `outputs` has taken the output tokens
        before `start`."""
        head: list[int] = []
        if echo:
            tok = self.tokenizer
            special = set() if tok is None else {i for i, t in tok.added_tokens_decoder.items() if t.special}
            # `prompt_text` keeps the special tokens the detokenizer skips; without a tokenizer
            # the text is the tokens' own.
            head = TextOffsets(tok, lambda t: self.token_text(t) if tok is None or t in special else "").take(
                out.prompt_token_ids[:len(out.prompt_logprobs or [])])
        return head + ([] if self.score_only else outputs.take(out.token_ids[start:len(out.logprobs or [])]))

    def token_label(self, token: int) -> str:
        """A token as logprobs name it: its text, or, for a piece of a character (whose text alone
        is U+FFFD), its bytes escaped as OpenAI's API writes them ("bytes:\\xf0\\x9f"), so that
        two pieces never share one key of a completion's top_logprobs."""
        text = self.token_text(token)
        if "\ufffd" not in text or (raw := self.token_bytes(token)) == text.encode():
            return text
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def completion_logprobs(self, entries: list[tuple[int, TokenLogprobs | None]],
                            offsets: list[int]) -> dict[str, Any]:
        """`offsets`: where each entry's token starts in the choice's text."""
        return {"tokens": [self.token_label(t) for t, _ in entries],
                "token_logprobs": [lp.logprob if lp else None for _, lp in entries],
                "top_logprobs": [self.top_logprobs(lp) if lp else None for _, lp in entries],
                "text_offset": offsets}

    def top_logprobs(self, lp: TokenLogprobs) -> dict[str, float]:
        """The top tokens and, as OpenAI's completions do, the chosen one where it is not among
        them (sampled below the top k): up to k + 1 entries."""
        top = {self.token_label(k): v for k, v in lp.top.items()}
        if lp.token_id not in lp.top:
            top.setdefault(self.token_label(lp.token_id), lp.logprob)
        return top

    def chat_logprobs(self, entries: list[tuple[int, TokenLogprobs | None]]) -> dict[str, Any]:
        def item(token: int, logprob: float) -> dict[str, Any]:
            return {"token": self.token_label(token), "logprob": logprob, "bytes": list(self.token_bytes(token))}
        return {"content": [{**item(t, lp.logprob), "top_logprobs": [item(k, v) for k, v in lp.top.items()]}
                            for t, lp in entries if lp is not None]}
