"""hf_decode_nll: decode through HF's caches matches a full forward; quanto's quantized cache stays close."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from kvserve.eval.hf_quantized import hf_decode_nll, perplexity

L, PREFILL = 40, 20


# The first 40 tokens (add_special_tokens=False) of two encyclopedia-style passages, tokenized once with the
# bundled model's tokenizer and pasted here, so the test needs neither the tokenizer nor a data file:
#   "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named
#    after the engineer Gustave Eiffel, whose company designed and built the tower from"
#   "Photosynthesis is the process by which green plants and some other organisms use sunlight to synthesize
#    foods from carbon dioxide and water. In plants, photosynthesis generally involves the green pigment
#    chlorophyll and generates oxygen as a by"
TOKENS = [
    [504, 414, 46682, 18669, 314, 253, 34554, 29, 1009, 27672, 11637, 335, 260, 21633, 367, 7621, 281, 7042, 28,
     4649, 30, 657, 314, 3365, 990, 260, 10776, 26821, 1134, 414, 46682, 28, 3449, 2727, 2724, 284, 2837, 260,
     11637, 429],
    [33580, 14870, 314, 260, 980, 411, 527, 2654, 2109, 284, 634, 550, 6896, 722, 8118, 288, 30782, 3111, 429,
     3118, 7600, 284, 913, 30, 533, 2109, 28, 19173, 3178, 3445, 260, 2654, 20864, 29677, 284, 13313, 4983,
     347, 253, 411],
]


@pytest.fixture(scope="module")
def windows() -> torch.Tensor:
    w = torch.tensor(TOKENS)
    assert w.shape == (2, L)
    return w


@pytest.fixture(scope="module")
def dynamic(hf_smol: Any, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return hf_decode_nll(hf_smol, windows, PREFILL, cache="dynamic", progress=False)


def _full_forward_reference(model: Any, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent reference: one causal forward over each whole window, no cache."""
    with torch.inference_mode():
        logits = model(input_ids=windows, use_cache=False).logits  # [W, L, V]
    pred = logits[:, PREFILL - 1 : L - 1].double()  # position t-1 predicts token t
    targets = windows[:, PREFILL:]
    nll = -pred.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    return nll, pred.argmax(-1)


@pytest.mark.model
def test_dynamic_matches_full_forward(hf_smol: Any, windows: torch.Tensor,
                                      dynamic: tuple[torch.Tensor, torch.Tensor]) -> None:
    nll, argmax = dynamic
    assert nll.shape == argmax.shape == (2, L - PREFILL)
    assert nll.dtype == torch.float64 and argmax.dtype == torch.long
    ref_nll, ref_argmax = _full_forward_reference(hf_smol, windows)
    torch.testing.assert_close(nll, ref_nll, atol=1e-4, rtol=0)
    assert (argmax == ref_argmax).float().mean() > 0.95  # near-ties may flip
    assert (nll > 0).all()


@pytest.mark.model
def test_rejects_bad_arguments(hf_smol: Any, windows: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="prefill_len"):
        hf_decode_nll(hf_smol, windows, L, progress=False)
    with pytest.raises(ValueError, match="unknown cache"):
        hf_decode_nll(hf_smol, windows, PREFILL, cache="nope", progress=False)
    # A missing backend fails up front, naming the pip command.
    monkeypatch.setattr("kvserve.eval.hf_quantized.is_hqq_available", lambda: False)
    with pytest.raises(ImportError, match="pip install hqq"):
        hf_decode_nll(hf_smol, windows, PREFILL, cache="hqq", progress=False)


@pytest.mark.model
def test_quanto_quantized_cache_is_close_and_2bit_worse(hf_smol: Any, windows: torch.Tensor,
                                                        dynamic: tuple[torch.Tensor, torch.Tensor]) -> None:
    pytest.importorskip("optimum.quanto", reason="needs optimum-quanto: pip install optimum-quanto")
    # residual 4 (< the 20 decoded tokens): the decoded states get quantized too, not just the prefill's.
    kw = dict(cache="quanto", q_group_size=64, residual_length=4, progress=False)
    nll4, _ = hf_decode_nll(hf_smol, windows, PREFILL, nbits=4, **kw)
    nll2, _ = hf_decode_nll(hf_smol, windows, PREFILL, nbits=2, **kw)
    nll_fp = dynamic[0]

    diff4 = (nll4 - nll_fp).abs().mean().item()
    diff2 = (nll2 - nll_fp).abs().mean().item()
    assert diff4 > 0  # quantization really happened
    assert abs(perplexity(nll4) / perplexity(nll_fp) - 1) < 0.2
    assert diff2 > diff4
    assert perplexity(nll2) > perplexity(nll4)
