"""The memory planner on windowed models (Gemma 3, Mistral v0.1): the presets against the published
config.json files, and what the hybrid KV cache holds against figures worked out by hand here.

A full layer holds ceil(n / 16) blocks of a sequence of n tokens; a sliding layer of window w the
blocks covering positions max(0, n - w) .. n - 1. Gemma 3 270M and 1B keep one KV head of 256
elements, so one layer's block of 16 tokens is 16 x 2 (K, V) x 256 x 2 bytes = 16,384 bytes in fp16.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from transformers import Gemma3TextConfig, MistralConfig

from kvserve.cache.kv_plan import KVPlan
from kvserve.diagnostics.kv_group_pricing import (KVLayout, contiguous_bytes, layer_groups, layer_ranges, sequence_price,
                                                  windowed_fit)
from kvserve.diagnostics.memory_planner import format_plan, gguf_shape, kv_bytes, main, sequences_that_fit
from kvserve.model.config import PRESETS, ModelConfig

GiB = 2**30
FP16 = KVLayout("fp16", block_size=16)
LAYER_BLOCK = 16 * 2 * 1 * 256 * 2  # Gemma 3 270M / 1B: one layer's block, bytes


def gemma3_pattern(layers: int) -> list[str]:
    """`layer_types` as the files spell it: five sliding layers, then a full one."""
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]


# What each model's config.json says (the 4B's and 27B's text_config; the rest their defaults),
# read through transformers' config class as the Hub's files are.
PUBLISHED = {
    # huggingface.co/google/gemma-3-270m(-it)/blob/main/config.json
    "gemma-3-270m": Gemma3TextConfig(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, sliding_window=512,
        query_pre_attn_scalar=256, layer_types=gemma3_pattern(18)),
    # huggingface.co/google/gemma-3-1b-it/blob/main/config.json
    "gemma-3-1b": Gemma3TextConfig(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, sliding_window=512,
        query_pre_attn_scalar=256, layer_types=gemma3_pattern(26)),
    # huggingface.co/google/gemma-3-4b-it/blob/main/config.json, text_config
    "gemma-3-4b": Gemma3TextConfig(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                                   rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window=1024),
    # huggingface.co/google/gemma-3-27b-it/blob/main/config.json, text_config
    "gemma-3-27b": Gemma3TextConfig(
        head_dim=128, hidden_size=5376, intermediate_size=21504, num_attention_heads=32, num_hidden_layers=62,
        num_key_value_heads=16, query_pre_attn_scalar=168, rope_scaling={"factor": 8.0, "rope_type": "linear"},
        sliding_window=1024),
    # huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json
    "mistral-7b-v0.1": MistralConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=32768, rope_theta=10000.0, rms_norm_eps=1e-5,
        sliding_window=4096, tie_word_embeddings=False),
}
ARCHITECTURE = {"gemma": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM"}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_the_presets_are_the_published_configs(preset: str) -> None:
    d = PUBLISHED[preset].to_dict()
    d["architectures"] = [ARCHITECTURE[preset.split("-")[0]]]
    # Presets are shapes; the special tokens are left out of every one.
    assert replace(ModelConfig.from_hf_dict(d), bos_token_id=None, eos_token_id=None) == PRESETS[preset]


def test_the_presets_layer_groups() -> None:
    """Layer i of a Gemma 3 is global when (i + 1) % 6 == 0; Mistral v0.1 windows every layer."""
    expected = {"gemma-3-270m": ((5, 11, 17), 512), "gemma-3-1b": ((5, 11, 17, 23), 512),
                "gemma-3-4b": ((5, 11, 17, 23, 29), 1024),
                "gemma-3-27b": ((5, 11, 17, 23, 29, 35, 41, 47, 53, 59), 1024)}
    for name, (full, window) in expected.items():
        cfg = PRESETS[name]
        sliding = tuple(i for i in range(cfg.num_layers) if i not in full)
        assert [(g.window, g.layers) for g in layer_groups(cfg)] == [(None, full), (window, sliding)], name
        assert [(g.window, g.layers) for g in layer_groups(cfg, hybrid=False)] == [(None, tuple(range(cfg.num_layers)))]
    assert [(g.window, len(g.layers)) for g in layer_groups(PRESETS["mistral-7b-v0.1"])] == [(4096, 32)]
    assert layer_ranges(layer_groups(PRESETS["gemma-3-1b"])[1].layers) == "0-4, 6-10, 12-16, 18-22, 24-25"


# (preset, tokens) -> (layer blocks held between steps, layer blocks with every layer full), by hand.
HAND_WORKED_BLOCKS = {
    # 3 full layers x 8192 / 16 = 512 blocks; 15 sliding ones: positions 7680..8191, blocks 480..511 = 32.
    ("gemma-3-270m", 8192): (3 * 512 + 15 * 32, 18 * 512),
    # 3 x 2048; sliding: positions 32256..32767, blocks 2016..2047 = 32 (the window's cost stays put).
    ("gemma-3-270m", 32768): (3 * 2048 + 15 * 32, 18 * 2048),
    # 4 full layers, 22 sliding.
    ("gemma-3-1b", 8192): (4 * 512 + 22 * 32, 26 * 512),
    ("gemma-3-1b", 32768): (4 * 2048 + 22 * 32, 26 * 2048),
    # Not on a block edge: 63 blocks in a full layer; positions 488..999 lie in blocks 30..62 = 33,
    # the most a window of 512 ever spans (512 / 16 + 1).
    ("gemma-3-270m", 1000): (3 * 63 + 15 * 33, 18 * 63),
}


@pytest.mark.parametrize(("preset", "tokens"), sorted(HAND_WORKED_BLOCKS))
def test_bytes_per_sequence_hand_worked(preset: str, tokens: int) -> None:
    held_blocks, full_blocks = HAND_WORKED_BLOCKS[(preset, tokens)]
    price = sequence_price(PRESETS[preset], FP16, tokens)
    assert (price.held, price.full) == (held_blocks * LAYER_BLOCK, full_blocks * LAYER_BLOCK)
    assert sequence_price(PRESETS[preset], FP16, tokens, hybrid=False).held == price.full


def test_gemma_3_figures_in_bytes() -> None:
    """The report's figures, spelled out: 270M and 1B at 8k and 32k tokens, hybrid against full."""
    figures = {(name, n): (sequence_price(PRESETS[name], FP16, n).held, sequence_price(PRESETS[name], FP16, n).full)
               for name in ("gemma-3-270m", "gemma-3-1b") for n in (8192, 32768)}
    assert figures == {
        ("gemma-3-270m", 8192): (33_030_144, 150_994_944),     # 31.5 MiB vs 144 MiB
        ("gemma-3-270m", 32768): (108_527_616, 603_979_776),   # 103.5 MiB vs 576 MiB
        ("gemma-3-1b", 8192): (45_088_768, 218_103_808),       # 43 MiB vs 208 MiB
        ("gemma-3-1b", 32768): (145_752_064, 872_415_232),     # 139 MiB vs 832 MiB
    }
    # Every layer full, block by block, is the planner's token-exact figure on a block edge.
    assert kv_bytes(PRESETS["gemma-3-1b"], FP16, 1, 32768) == 872_415_232


def test_mistral_within_its_window_holds_every_block() -> None:
    cfg = PRESETS["mistral-7b-v0.1"]
    block = 16 * 2 * 8 * 128 * 2  # 65,536 bytes: one layer's block, 8 KV heads of 128
    for tokens in (1, 1000, 4096):  # nothing has left the window yet
        price = sequence_price(cfg, FP16, tokens)
        assert price.held == price.full == 32 * -(-tokens // 16) * block
    # 8192 tokens: positions 4096..8191, blocks 256..511, half of them.
    assert sequence_price(cfg, FP16, 8192).held == 32 * 256 * block == sequence_price(cfg, FP16, 8192).full // 2


def test_what_fits_a_budget_with_windows() -> None:
    cfg = PRESETS["gemma-3-270m"]
    fit = windowed_fit(cfg, FP16, GiB, 8192, cfg.max_position)
    # Between steps 33,030,144 bytes each: 1,073,741,824 // 33,030,144 = 32.
    assert fit.paged == 32
    # A whole 8192-token prompt holds all 18 x 512 blocks (150,994,944 bytes) for its prefill step, beside
    # the others' 33,030,144 each: 1 + (1,073,741,824 - 150,994,944) // 33,030,144 = 1 + 27.
    assert fit.whole_prompts == 28
    # Every layer full: 1 GiB / 16,384 = 65,536 layer blocks, 9216 a sequence -> 7.
    assert sequences_that_fit(cfg, FP16, GiB, 8192).paged == 7
    # Contiguous: 3 layers x 32,768 tokens + 15 x 512, at 1,024 bytes per token and layer = 108,527,616.
    assert contiguous_bytes(cfg, FP16, 32768) == (3 * 32768 + 15 * 512) * 1024
    assert fit.contiguous == GiB // 108_527_616 == 9
    assert windowed_fit(cfg, FP16, 150_994_943, 8192, 32768).whole_prompts == 0  # not even one prompt's prefill


def test_a_per_layer_plan_prices_each_group_in_its_own_format(tmp_path: Path) -> None:
    """Layer 0 slides (window 32) in int8, layer 1 is full in bf16: the mean format would misprice both."""
    cfg = ModelConfig(vocab_size=1, hidden_size=32, intermediate_size=128, num_layers=2, num_heads=2,
                      num_kv_heads=2, head_dim=16, max_position=4096, sliding_window=32, sliding_layers=(0,))
    path = tmp_path / "plan.json"
    KVPlan((("int8", "int8"), ("auto", "auto"))).save(path)
    price = sequence_price(cfg, KVLayout(f"plan:{path}"), 256)
    # int8: 2 heads x (16 + a 2-byte scale) x 2 (K, V) = 72 bytes per token; bf16: 2 x 16 x 2 x 2 = 128.
    # Layer 1 holds 256 / 16 = 16 blocks; layer 0 positions 224..255, blocks 14..15.
    assert price.held == 16 * 16 * 128 + 2 * 16 * 72
    assert price.full == 16 * 16 * (128 + 72)


def test_the_cli_names_the_groups(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--preset", "gemma-3-1b", "--seq-len", "32768", "--budget", "1GiB"])
    out = capsys.readouterr().out
    assert "sliding window 512 on 22 of 26 layers" in out
    # 4 x 2048 x 16,384 and 22 x 32 x 16,384 bytes.
    assert "full attention:     4 layers (5, 11, 17, 23), 2,048 blocks each: 134,217,728 bytes" in out
    assert ("sliding window 512: 22 layers (0-4, 6-10, 12-16, 18-22, 24-25), 32 blocks each (at most 33): "
            "11,534,336 bytes") in out
    assert "KV per sequence: 145,752,064 bytes (139.00 MiB) held between steps" in out
    assert "every layer full: 872,415,232 bytes (832.00 MiB)" in out
    assert "the windows save 83.3%" in out  # 1 - 8896 / 53248 layer blocks
    # 1 GiB // 145,752,064 = 7; whole prompts: 1 + (1 GiB - 872,415,232) // 145,752,064 = 2.
    assert ("  paged:      7 held between steps (145,752,064 bytes each); 2 if each arrives as one 32,768-token "
            "prompt") in out

    main(["--preset", "gemma-3-1b", "--seq-len", "32768", "--no-hybrid"])
    out = capsys.readouterr().out
    assert "KV cache: 872,415,232 bytes" in out and "the windows only mask" in out and "KV layer groups" not in out


def test_attention_kinds_of_a_windowed_model_are_priced_as_held() -> None:
    text = format_plan(PRESETS["gemma-3-270m"], FP16, 1, 8192, compare=True)
    # Its 4 query heads as 4 KV heads hold 4 x 33,030,144 bytes between steps.
    assert "  MHA          4        73,728            132,120,576         1" in text
    assert "33,030,144         4  <- this model" in text


def test_a_model_without_windows_prints_as_before() -> None:
    text = format_plan(PRESETS["llama-3-8b"], FP16, 2, 4096, name="llama-3-8b", budget_bytes=GiB)
    assert "KV layer groups" not in text and "sliding" not in text and "--no-hybrid" not in text
    assert "KV cache: 1,073,741,824 bytes (1.00 GiB)" in text  # 2 x 4096 x 131,072


def test_a_gemma3_gguf_is_priced_with_its_windows(tmp_path: Path) -> None:
    """A GGUF names the window only; llama.cpp's pattern (every sixth layer global) gives the rest."""
    from tests.model.test_gguf_gemma3 import SHAPE, tiny_gemma3, write_gemma3_gguf

    path = tmp_path / "gemma3.gguf"
    write_gemma3_gguf(tiny_gemma3(), path, quantized=False)
    assert gguf_shape(path).layer_windows == (SHAPE["sliding_window"],) * 5 + (None,)


@pytest.mark.model
def test_the_gemma3_gguf_reads_its_windows() -> None:
    """Google's Gemma 3 270M as llama.cpp converted it: the same shape and layer pattern as the preset
    (the file names the window; llama.cpp fixes every sixth layer global)."""
    from kvserve.model.named_models import named_model_path

    try:
        path = named_model_path("gemma3-270m")
    except FileNotFoundError:
        pytest.skip("the gemma3-270m GGUF package is not installed")
    cfg, preset = gguf_shape(path), PRESETS["gemma-3-270m"]
    assert cfg.layer_windows == preset.layer_windows
    assert sequence_price(cfg, FP16, 8192) == sequence_price(preset, FP16, 8192)
