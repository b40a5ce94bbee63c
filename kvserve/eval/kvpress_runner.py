"""Runs NVIDIA kvpress presses on teacher-forced windows, for `kvserve eval --evictions`.

Standalone on purpose: it runs inside a separate environment with kvpress and transformers < 5.3
(`benchmarks/kvpress_env.sh`), where kvserve is not installed, as
`python kvpress_runner.py spec.json out.json`. The spec names an HF model directory, the
windows (token ids), the prefill length, the dtype and the presses with their settings.

Protocol, the same as kvserve's rows with kv_evict_during_decode off: each window's first
`prefill` tokens are one prefill forward, compressed by the press (kvpress compresses during
prefill only); the rest are fed one token per step at their true positions into the
compressed cache. Per window and target: the NLL and the argmax of the next-token distribution.
"""
from __future__ import annotations

import contextlib
import json
import sys

import torch


def presses(spec: dict) -> dict:
    import kvpress

    ratio = 1 - spec["budget"] / spec["prefill"]
    return {
        "window": lambda: kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=spec["sink_tokens"]),
        "snapkv": lambda: kvpress.SnapKVPress(compression_ratio=ratio, window_size=spec["observation_window"],
                                              kernel_size=spec["pooling_kernel"]),
        "tova": lambda: kvpress.TOVAPress(compression_ratio=ratio),
        "h2o": lambda: kvpress.ObservedAttentionPress(compression_ratio=ratio),
    }


@torch.inference_mode()
def run(model: torch.nn.Module, windows: torch.Tensor, prefill: int,
        press: object | None) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import DynamicCache

    cache = DynamicCache()
    hooked = press(model) if press is not None else contextlib.nullcontext()
    with hooked:
        out = model(windows[:, :prefill], past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1].float()]
    for t in range(prefill, windows.shape[1] - 1):
        position = torch.full((windows.shape[0], 1), t)
        out = model(windows[:, t:t + 1], past_key_values=cache, position_ids=position, use_cache=True)
        logits.append(out.logits[:, -1].float())
    logprobs = torch.stack(logits, 1).log_softmax(-1)
    nll = -logprobs.gather(-1, windows[:, prefill:, None]).squeeze(-1)
    return nll, logprobs.argmax(-1)


def main() -> None:
    from transformers import AutoModelForCausalLM

    spec = json.loads(open(sys.argv[1]).read())
    torch.set_num_threads(spec.get("threads", torch.get_num_threads()))
    # Eager attention: ObservedAttentionPress (H2O) reads the attention weights.
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=getattr(torch, spec["dtype"]),
                                                 attn_implementation="eager").eval()
    windows = torch.tensor(spec["windows"])
    made = presses(spec)
    results = {}
    for name in ["full", *spec["policies"]]:
        nll, argmax = run(model, windows, spec["prefill"], None if name == "full" else made[name]())
        results[name] = {"nll": nll.tolist(), "argmax": argmax.tolist()}
        print(f"kvpress {name}: perplexity {nll.double().mean().exp().item():.4f}", flush=True)
    from importlib.metadata import version
    results["version"] = version("kvpress")
    open(sys.argv[2], "w").write(json.dumps(results))


if __name__ == "__main__":
    main()
