"""Teacher-forced decode NLL through HF transformers' KV caches, full precision or quantized.

A reference point for our own KV-cache formats: HF's `QuantizedCache` (KIVI-style, a full-precision
residual of up to `residual_length` tokens in front of group-wise quantized states) with the `quanto`
(`pip install optimum-quanto`) or `hqq` (`pip install hqq`) backend, next to its `DynamicCache`.

Note how HF's quantized layer behaves, since it shapes the numbers: the prefill's keys and values are
quantized as soon as they are stored (the prefill forward itself attends to them in full precision);
decoded tokens then pile up in the residual, and when it reaches `residual_length` everything cached is
dequantized, concatenated with the residual and quantized again.
"""

from __future__ import annotations

import sys

import torch
from tqdm import tqdm
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, QuantizedCache
from transformers.utils.import_utils import is_hqq_available, is_optimum_quanto_available, is_quanto_greater

# What makes each backend importable for transformers, and how to get it. optimum-quanto leaves torch
# alone (it only wants `ninja` on top, to build its CPU extension on first use), but check with
# `pip install --dry-run` first: should it ever ask for another torch, install it with --no-deps.
_BACKEND_INSTALL = {
    "quanto": "pip install optimum-quanto",
    "hqq": "pip install hqq",
}


def _check_backend(backend: str) -> None:
    if backend not in _BACKEND_INSTALL:
        raise ValueError(f"unknown cache {backend!r}: expected 'dynamic' or one of {sorted(_BACKEND_INSTALL)}")
    if backend == "quanto":
        available = is_optimum_quanto_available() and is_quanto_greater("0.2.5", accept_dev=True)
    else:
        available = is_hqq_available()
    if not available:
        raise ImportError(
            f"HF's quantized KV cache with the {backend!r} backend needs a package that is not installed "
            f"(or too old): {_BACKEND_INSTALL[backend]}"
        )


def make_hf_cache(model: PreTrainedModel, cache: str = "dynamic", nbits: int = 4, q_group_size: int = 64,
                  residual_length: int = 128) -> Cache:
    """A fresh HF cache for one sequence: `DynamicCache` for "dynamic", else a `QuantizedCache`."""
    if cache == "dynamic":
        return DynamicCache(config=model.config)
    _check_backend(cache)
    return QuantizedCache(backend=cache, config=model.config, nbits=nbits, q_group_size=q_group_size,
                          residual_length=residual_length)


def _nll_and_argmax(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [V], target [] -> (nll float64 [], argmax long [])."""
    logp = logits.double().log_softmax(-1)
    return -logp[target], logits.argmax(-1)


def hf_decode_nll(model: PreTrainedModel, windows: torch.Tensor, prefill_len: int, cache: str = "dynamic",
                  nbits: int = 4, q_group_size: int = 64, residual_length: int = 128, *,
                  progress: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """windows: [W, L] token ids. For each window: prefill tokens[:prefill_len] in one forward,
    then feed tokens[prefill_len:L-1] one at a time through the cache (teacher forcing).
    Returns (nll, argmax), each [W, L - prefill_len]: the negative log-likelihood (natural log, float64)
    of target token tokens[t] for t in prefill_len..L-1 given tokens[:t], and the model's argmax
    prediction at that position. cache: "dynamic" (HF's full-precision DynamicCache) or the
    quantized backend name ("quanto" / "hqq").

    `nbits`, `q_group_size` and `residual_length` only apply to the quantized backends. Windows run one
    at a time (batch 1). `progress`: show a tqdm bar over decode steps; None shows it on a terminal only.
    """
    if windows.dim() != 2:
        raise ValueError(f"windows must be [W, L] token ids, got shape {tuple(windows.shape)}")
    num_windows, length = windows.shape
    if not 1 <= prefill_len < length:
        raise ValueError(f"prefill_len must be in [1, {length - 1}] for windows of {length} tokens, got {prefill_len}")
    if cache != "dynamic":
        _check_backend(cache)  # fail before any work, not inside the first window
    if progress is None:
        progress = sys.stderr.isatty()

    n_targets = length - prefill_len
    nll = torch.empty(num_windows, n_targets, dtype=torch.float64)
    argmax = torch.empty(num_windows, n_targets, dtype=torch.long)
    device = model.device
    desc = "hf dynamic" if cache == "dynamic" else f"hf {cache} {nbits}-bit"
    bar = tqdm(total=num_windows * n_targets, desc=desc, unit="tok", disable=not progress)
    with torch.inference_mode(), bar:
        for w in range(num_windows):
            tokens = windows[w].to(device=device, dtype=torch.long)
            kv = make_hf_cache(model, cache, nbits=nbits, q_group_size=q_group_size,
                               residual_length=residual_length)
            # `cache=` is the 5.x name of the old `past_key_values=` (deprecated, removal announced for 5.40).
            # Prefill: only the last position's logits are needed, for target tokens[prefill_len].
            out = model(input_ids=tokens[None, :prefill_len], cache=kv, use_cache=True, logits_to_keep=1)
            for i in range(n_targets):
                t = prefill_len + i  # position of the target token
                if i > 0:
                    out = model(input_ids=tokens[None, t - 1 : t], cache=kv, use_cache=True,
                                logits_to_keep=1)
                nll[w, i], argmax[w, i] = _nll_and_argmax(out.logits[0, -1], tokens[t])
                bar.update(1)
            if kv.get_seq_length() != length - 1:  # every input token went through the cache exactly once
                raise RuntimeError(f"cache holds {kv.get_seq_length()} tokens, expected {length - 1}")
    return nll, argmax


def perplexity(nll: torch.Tensor) -> float:
    """exp of the mean NLL over every target."""
    return float(torch.exp(nll.double().mean()))
