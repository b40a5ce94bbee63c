"""Gemma 3 text, Gemma 2 and the sliding-window layers of Mistral and Qwen2, written by HF transformers' own
config classes and `save_pretrained`, give transformers' logits in kvserve (fp32, within 1e-4) over
a prompt five times the window and 32 greedy tokens, through chunked prefill and prefix-cache hits.
The window masks attention only ("hybrid off"): every layer keeps its whole KV."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, PreTrainedConfig, PreTrainedModel, Qwen2Config

from kvserve import LLM, SamplingParams
from kvserve.attention.torch_sdpa import TorchSDPABackend
from kvserve.cache.kv_pool import KVPool
from kvserve.engine.cpu_stack import CPUDecodeStack
from kvserve.kernels import cpu_extension
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from tests.model.test_architectures import CPU, assert_logprobs_equal_hf, edit_config, hf_logprobs, save_tiny
from tests.model.test_loader import logits

WINDOW = 8
SHAPE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "max_position_embeddings": 512, "initializer_range": 0.2}
# Gemma 3's shape in small: one KV head for four query heads, head_dim 32 (not hidden / heads), a
# scale of its own, local and global layers mixed (the last global, as in every Gemma 3), the
# global ones with Gemma 3 4B+'s linear RoPE scaling and the final logits soft-capped.
GEMMA = {**SHAPE, "num_hidden_layers": 4, "num_key_value_heads": 1, "head_dim": 32, "sliding_window": WINDOW,
         "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
         "query_pre_attn_scalar": 24, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
         "final_logit_softcapping": 30.0}
# Gemma 2: no q/k norms, one RoPE base, attention logits capped (at 5, well inside these logits'
# range, so the cap is exercised), every other layer sliding (its default layer_types).
GEMMA2 = {**SHAPE, "num_hidden_layers": 4, "num_key_value_heads": 1, "head_dim": 32, "sliding_window": WINDOW,
          "query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 30.0}
FAMILIES: dict[str, Callable[[], PreTrainedConfig]] = {
    "gemma3": lambda: Gemma3TextConfig(**GEMMA),
    "gemma2": lambda: Gemma2Config(**GEMMA2),
    "mistral": lambda: MistralConfig(**SHAPE, num_hidden_layers=2, num_key_value_heads=2, sliding_window=WINDOW),
    # The window from max_window_layers up: layer 0 full, layer 1 sliding.
    "qwen2": lambda: Qwen2Config(**SHAPE, num_hidden_layers=2, num_key_value_heads=2, use_sliding_window=True,
                                 sliding_window=WINDOW, max_window_layers=1),
}
PROMPT = [(7 * i + 3) % 128 for i in range(5 * WINDOW)]
OTHER = [(11 * i + 5) % 128 for i in range(3 * WINDOW + 3)]
kernels = cpu_extension.load()


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, PreTrainedModel]]:
    root = tmp_path_factory.mktemp("windowed")
    return {name: (root / name, save_tiny(make(), root / name)) for name, make in FAMILIES.items()}


def test_the_configs_read_as_transformers_reads_them(tiny_models: dict) -> None:
    gemma = load_model(tiny_models["gemma3"][0], torch.float32, CPU).config
    assert gemma.layer_windows == (WINDOW, None, WINDOW, None)
    assert gemma.rope_local_theta == 10000.0 and gemma.rope_theta == 1e6 and gemma.rope_scaling.factor == 8.0
    assert gemma.norm_offset and gemma.sandwich_norms and gemma.scale_embeddings and gemma.qk_norm
    assert (gemma.num_kv_heads, gemma.head_dim, gemma.query_pre_attn_scalar) == (1, 32, 24)
    assert gemma.tie_word_embeddings and gemma.final_logit_softcapping == 30.0
    gemma2 = load_model(tiny_models["gemma2"][0], torch.float32, CPU).config
    assert gemma2.layer_windows == (WINDOW, None, WINDOW, None) and gemma2.attn_logit_softcapping == 5.0
    assert gemma2.norm_offset and gemma2.sandwich_norms and not gemma2.qk_norm and gemma2.rope_local_theta is None
    assert ModelConfig.from_hf_dict(gemma2.to_hf_dict()) == gemma2
    assert load_model(tiny_models["mistral"][0], torch.float32, CPU).config.layer_windows == (WINDOW, WINDOW)
    assert load_model(tiny_models["qwen2"][0], torch.float32, CPU).config.layer_windows == (None, WINDOW)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.skipif(
    kernels is None, reason="needs the compiled CPU kernels"))])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_equal_transformers(tiny_models: dict, family: str, compiled: bool) -> None:
    """A 40-token prompt in chunks of at most 16 tokens, then 32 greedy steps; then the same prompt
    again beside another (a prefix-cache hit of two blocks, the rest attending to cached keys across
    the window's edge, in a step whose sequences differ in length): every prompt and output
    position's log-probabilities equal transformers' over the same tokens, and the greedy tokens are
    its argmax. `compiled`: the model's ops from the CPU kernels (RoPE from both tables)."""
    path, hf = tiny_models[family]
    llm = LLM(model=str(path), dtype="float32", device="cpu", attention_backend="torch", cpu_kernels=compiled,
              kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16,
              enable_prefix_caching=True)
    scored = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=-1, prompt_logprobs=-1)
    first = llm.generate([PROMPT], scored, use_tqdm=False)[0]
    assert_logprobs_equal_hf(hf, PROMPT, first, scored_prompt=True)
    # Prompt log-probs would compute every prompt position: these two ask for the outputs' alone.
    stats = llm.engine.block_manager.prefix_stats
    cached = stats.cached_tokens
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=-1)
    again = llm.generate([PROMPT, OTHER], params, use_tqdm=False)
    assert stats.cached_tokens - cached == 32  # the prompt's two whole blocks came from the cache
    for prompt, out in ((PROMPT, again[0]), (OTHER, again[1])):
        assert_logprobs_equal_hf(hf, prompt, out, scored_prompt=False)
    assert again[0].token_ids == first.token_ids

@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_window_changes_the_logits_under_test(tiny_models: dict, tmp_path: Path, family: str) -> None:
    """The same weights with the window covering every position give other logits over the prompt:
    a model that ignored the window, the fault this file guards against, fails the test above."""
    path, hf = tiny_models[family]
    shutil.copytree(path, tmp_path / "wide")
    edit_config(tmp_path / "wide", sliding_window=4096)
    wide = load_model(tmp_path / "wide", torch.float32, CPU)
    assert not wide.config.sliding_layers
    ours = torch.log_softmax(logits(wide.model, wide.config, PROMPT), dim=-1)
    assert (ours - hf_logprobs(hf, PROMPT)).abs().max().item() > 1e-2


def test_each_gemma_delta_changes_the_logits(tiny_models: dict, tmp_path: Path) -> None:
    """The local RoPE base, the global layers' scaling and the attention scale each matter on
    these weights, so reading any of them wrong fails the parity test."""
    path, hf = tiny_models["gemma3"]
    want = hf_logprobs(hf, PROMPT)
    config = json.loads((path / "config.json").read_text())
    rope = config["rope_parameters"]
    for name, change in {"local base": {"rope_parameters": {**rope, "sliding_attention": {"rope_theta": 1e6}}},
                         "scaling": {"rope_parameters": {**rope, "full_attention": {"rope_theta": 1e6}}},
                         "scale": {"query_pre_attn_scalar": 32}}.items():
        shutil.copytree(path, tmp_path / name)
        edit_config(tmp_path / name, **change)
        changed = load_model(tmp_path / name, torch.float32, CPU)
        got = torch.log_softmax(logits(changed.model, changed.config, PROMPT), dim=-1)
        assert (got - want).abs().max().item() > 1e-2, name


def test_gemma2s_attention_cap_changes_the_logits(tiny_models: dict, tmp_path: Path) -> None:
    path, hf = tiny_models["gemma2"]
    shutil.copytree(path, tmp_path / "uncapped")
    edit_config(tmp_path / "uncapped", attn_logit_softcapping=None)
    uncapped = load_model(tmp_path / "uncapped", torch.float32, CPU)
    assert uncapped.config.attn_logit_softcapping is None
    got = torch.log_softmax(logits(uncapped.model, uncapped.config, PROMPT), dim=-1)
    assert (got - hf_logprobs(hf, PROMPT)).abs().max().item() > 1e-2


def test_only_the_torch_backend_caps_attention_logits(tiny_models: dict) -> None:
    """auto picks torch for Gemma 2 (saying why), and a backend without the cap is refused naming
    the option."""
    path, _ = tiny_models["gemma2"]
    llm = LLM(model=str(path), dtype="float32", device="cpu", kv_cache_memory="4MiB", max_model_len=256)
    assert llm.engine.runner.backend.name == "torch" and llm.engine.runner.backend.softcap == 5.0
    if kernels is not None:
        with pytest.raises(ValueError, match="attention_backend: 'cpu' cannot serve .* caps its attention logits"):
            LLM(model=str(path), dtype="float32", device="cpu", attention_backend="cpu", kv_cache_memory="4MiB",
                max_model_len=256)


def test_the_fused_cpu_stack_declines_gemma3_and_windows(tiny_models: dict) -> None:
    for family, reason in (("gemma3", "Gemma's layer"), ("mistral", "sliding-window layers (window 8)")):
        loaded = load_model(tiny_models[family][0], torch.float32, CPU)
        cfg = loaded.config
        backend = TorchSDPABackend(KVPool(cfg.num_layers, 1, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                                          CPU), cfg.num_heads)
        assert reason in CPUDecodeStack.unsupported(loaded.model, backend, "small-batch", None)
