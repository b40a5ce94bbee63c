"""Quality of a KV-cache configuration, measured through the engine's own cache path.

Every number comes from real prefill and decode steps into the configured pages (compressed or
not), never from a fake-quantized dense tensor:
- teacher-forced decoding of WikiText-2 windows: the first `prefill_len` tokens are prefilled, the
  rest are fed one token per step, and each step's next-token distribution is kept. Perplexity is
  over the decoded targets (positions prefill_len .. L-1); KL divergence and top-1 agreement compare
  each distribution with the reference cache's at the same position;
- greedy continuation agreement: tokens generated before the first divergence from the reference;
- passkey retrieval: a 5-digit key hidden at a seeded depth in filler text, asked for at the end.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams


def forcing(continuation: list[int]) -> SamplingParams:
    """A request whose output is `continuation`, one cached decode step per token, returning
    the whole distribution before each (teacher forcing)."""
    return SamplingParams(max_tokens=len(continuation), temperature=0, ignore_eos=True, logprobs=-1,
                          forced_token_ids=list(continuation))


@torch.inference_mode()
def forced_logprobs(llm: LLM, windows: list[list[int]], prefill_len: int,
                    cache_salt: str | None = None) -> torch.Tensor:
    """log-softmax [W, L - prefill_len, vocab] (fp32) of the next token at positions prefill_len - 1
    .. L - 2 of every window: each window's first prefill_len tokens are its prompt, the rest are
    forced through the scheduler one cached decode step at a time, the windows run together."""
    bm = llm.engine.block_manager
    length = len(windows[0])
    if len(windows) * bm.blocks_for(length) > bm.num_blocks:
        raise ValueError("kv_cache_memory: the evaluation windows do not fit the KV pool together")
    params = [forcing(w[prefill_len:]) for w in windows]
    outs = llm.generate([list(w[:prefill_len]) for w in windows], params, use_tqdm=False, cache_salt=cache_salt)
    if any(o.num_preemptions for o in outs):  # a recomputed context would not be the cache under test
        raise ValueError("kv_cache_memory: the evaluation windows do not fit the KV pool together")
    # Filled in place: stacking each window and then the windows held three copies at once (3 GB
    # for 4 windows over Gemma 3's 262,144 tokens), this holds two.
    full = torch.empty(len(outs), len(outs[0].logprobs), outs[0].logprobs[0].full.shape[-1])
    for row, o in zip(full, outs):
        torch.stack([t.full for t in o.logprobs], out=row)
    return full


# Positions per fp64 slice in kl(): each slice's temporaries are about 4 fp64 copies of it, 2 GB at
# 256 positions over Gemma 3's vocabulary (the peak of a Gemma eval), 0.25 GB at 32.
KL_ROWS = 32


@dataclass
class DecodeQuality:
    perplexity: float
    kl: float          # mean KL(reference || this) per position, nats
    top1: float        # fraction of positions whose argmax equals the reference's
    nll: torch.Tensor  # [W, T]


def kl(reference: torch.Tensor, logprobs: torch.Tensor) -> float:
    """Mean KL(reference || logprobs) over positions [..., vocab] of log-probabilities, nats. In
    fp64, KL_ROWS positions at a time: whole, the fp64 copies of 4 windows over Gemma 3's 262,144
    tokens took ~8 GB, and a 12-window eval was killed for memory."""
    ref, got = reference.reshape(-1, reference.shape[-1]), logprobs.reshape(-1, logprobs.shape[-1])
    if not len(ref):
        return float("nan")
    total = 0.0
    for start in range(0, len(ref), KL_ROWS):
        r, g = ref[start:start + KL_ROWS].double(), got[start:start + KL_ROWS].double()
        total += (r.exp() * (r - g)).sum().item()
    return total / len(ref)


def top1(logprobs: torch.Tensor, reference: torch.Tensor) -> float:
    """The share of positions whose most likely token is the same in both [..., vocab]."""
    return (logprobs.argmax(-1) == reference.argmax(-1)).double().mean().item()


def compare(logprobs: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor) -> DecodeQuality:
    """logprobs, reference [W, T, V]; targets [W, T] token ids."""
    nll = -logprobs.gather(-1, targets[..., None]).squeeze(-1).double()
    return DecodeQuality(nll.mean().exp().item(), kl(reference, logprobs), top1(logprobs, reference), nll)


def greedy_agreement(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """Mean number of leading tokens equal to the reference's continuation (nan without prompts)."""
    if not reference:
        return float("nan")

    def prefix(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return sum(prefix(o, r) for o, r in zip(outputs, reference)) / len(reference)


PASSKEY_ANSWER_TOKENS = 8  # generated after a passkey prompt: the key's 5 digits, with room to spare
_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def passkey_prompts(tokenizer: object, context_len: int, trials: int, seed: int) -> list[tuple[str, str]]:
    """(prompt, key) pairs of about `context_len` tokens, the key at a random depth."""
    rng = random.Random(seed * 100_003 + context_len)
    filler_tokens = len(tokenizer.encode(_FILLER))  # type: ignore[attr-defined]
    repeats = max(1, (context_len - 60) // filler_tokens)
    prompts = []
    for _ in range(trials):
        key = str(rng.randint(10000, 99999))
        depth = rng.randint(0, repeats)
        haystack = (_FILLER * depth + f"The pass key is {key}. Remember it. {key} is the pass key. "
                    + _FILLER * (repeats - depth))
        prompt = ("There is important information hidden in this text. Find it and memorize it. "
                  + haystack + "What is the pass key? The pass key is")
        prompts.append((prompt, key))
    return prompts


def passkey_accuracy(llm: LLM, prompts: list[tuple[str, str]]) -> float:
    outs = llm.generate([p for p, _ in prompts], SamplingParams(max_tokens=PASSKEY_ANSWER_TOKENS, temperature=0),
                        use_tqdm=False)
    return sum(key in out.text for out, (_, key) in zip(outs, prompts)) / len(prompts)
