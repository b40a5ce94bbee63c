"""The KV-cache planner against hand-worked figures and against the engine's own pool."""
from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from kvserve.cache.kv_pool import KVPool
from kvserve.diagnostics.memory_planner import (
    KVLayout,
    bytes_per_element,
    compare_attention_kinds,
    explicit_shape,
    format_plan,
    kv_bytes,
    kv_bytes_per_token,
    lognormal_lengths,
    main,
    model_shape,
    paging_waste,
    sequences_that_fit,
)
from kvserve.model.config import PRESETS

GiB = 2**30

# fp16 bytes per token = 2 (K and V) x layers x kv_heads x head_dim x 2 bytes.
HAND_WORKED_FP16_PER_TOKEN = {
    "gpt3-175b": 4_718_592,  # 2 x 96 x 96 x 128 x 2 (MHA)
    "llama-2-7b": 524_288,  # 2 x 32 x 32 x 128 x 2 (MHA)
    "llama-2-70b": 327_680,  # 2 x 80 x 8 x 128 x 2 (GQA 8)
    "llama-3-8b": 131_072,  # 2 x 32 x 8 x 128 x 2 (GQA 8)
    "mistral-7b": 131_072,  # 2 x 32 x 8 x 128 x 2 (GQA 8)
    "mistral-7b-v0.1": 131_072,  # the same, a token in every layer (its window bounds a sequence's total)
    "gemma-3-270m": 18_432,  # 2 x 18 x 1 x 256 x 2 (MQA)
    "gemma-3-1b": 26_624,  # 2 x 26 x 1 x 256 x 2 (MQA)
    "gemma-3-4b": 139_264,  # 2 x 34 x 4 x 256 x 2 (GQA 4)
    "gemma-3-27b": 507_904,  # 2 x 62 x 16 x 128 x 2 (GQA 16)
    "falcon-7b": 8_192,  # 2 x 32 x 1 x 64 x 2 (MQA)
    "smollm2-135m": 23_040,  # 2 x 30 x 3 x 64 x 2 (GQA 3)
    "tiny": 256,  # 2 x 2 x 2 x 16 x 2
}


def test_hand_worked_values_cover_every_preset() -> None:
    assert set(HAND_WORKED_FP16_PER_TOKEN) == set(PRESETS)


@pytest.mark.parametrize("preset", sorted(HAND_WORKED_FP16_PER_TOKEN))
def test_bytes_per_token_for_each_preset(preset: str) -> None:
    cfg = model_shape(preset)
    expected = HAND_WORKED_FP16_PER_TOKEN[preset]
    assert kv_bytes_per_token(cfg, KVLayout("fp16")) == expected
    assert kv_bytes_per_token(cfg, KVLayout("bf16")) == expected
    assert kv_bytes_per_token(cfg, KVLayout("fp32")) == 2 * expected
    # 8-bit: a byte per element plus an fp16 scale per token and head, for K and V.
    scales = 2 * cfg.num_layers * cfg.num_kv_heads * 2
    assert kv_bytes_per_token(cfg, KVLayout("fp8_e4m3")) == kv_bytes_per_token(cfg, KVLayout("int8")) == expected // 2 + scales
    # int4 in groups of 16: half a byte per element, an fp16 scale and zero (4 B) per 16 elements;
    # expected counts 2 bytes per element.
    assert kv_bytes_per_token(cfg, KVLayout("int4", 16)) == expected // 4 + expected // 2 // 16 * 4
    # The engine's own 2-byte figure on ModelConfig must agree with the planner's.
    assert cfg.kv_bytes_per_token == expected


def test_gpt3_batch_total_is_exact() -> None:
    cfg = model_shape("gpt3-175b")
    # 2 x 32 x 96 x 96 x 128 x 2048 x 2 = 309,237,645,312 = 288 x 2^30
    assert kv_bytes(cfg, KVLayout("fp16"), 32, 2048) == 309_237_645_312 == 288 * GiB
    # One 2048-token sequence: 4,718,592 x 2048 = 9 GiB.
    assert kv_bytes(cfg, KVLayout("fp16"), 1, 2048) == 9 * GiB


def test_acceptance_command_prints_exact_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--preset", "gpt3-175b", "--batch", "32", "--seq-len", "2048", "--dtype", "fp16"])
    out = capsys.readouterr().out
    assert "KV cache: 309,237,645,312 bytes (288.00 GiB)" in out
    assert "KV per token: 4,718,592 bytes (4.50 MiB)" in out


def test_int4_groups_add_scale_and_zero() -> None:
    cfg = model_shape("llama-2-7b")
    # Each group of 128 carries an fp16 scale and an fp16 zero: 4 bytes over 128 elements.
    assert bytes_per_element(cfg, KVLayout("int4", 128)) == Fraction(1, 2) + Fraction(4, 128)
    # Llama-2-7B: 2 x 32 x 32 x 128 x (0.5 + 4/128) = 131,072 + 8,192.
    assert kv_bytes_per_token(cfg, KVLayout("int4", 128)) == 139_264
    with pytest.raises(ValueError, match="unknown KV dtype"):
        bytes_per_element(cfg, KVLayout("fp12"))


def test_kivi2_keys_per_channel_per_block() -> None:
    cfg = model_shape("llama-2-7b")
    # Per layer and KV head: keys 128 * 2 bits = 32 B per token plus an fp16 scale and zero per
    # channel per 16-token block (128 * 4 / 16 = 32 B); values 32 B + 4 groups * 4 B = 48 B.
    assert kv_bytes_per_token(cfg, KVLayout("kivi2")) == 32 * 32 * (32 + 32 + 48)
    # Blocks of 64 tokens and value groups of 64: keys 32 + 128 * 4 / 64 = 40 B, values 32 + 2 * 4 = 40 B,
    # i.e. 2.5 bits per value; the block size given is the one priced (it once stayed at 16).
    assert kv_bytes_per_token(cfg, KVLayout("kivi2", group_size=64, block_size=64)) == 32 * 32 * (40 + 40)
    assert "KV per token: 81,920 bytes" in format_plan(cfg, KVLayout("kivi2", 64, 64), 1, 64)
    # Exact sinks: each block's first key in fp16, 128 * 2 B / 64 tokens = 4 B more per token for keys:
    # 2.625 bits per value.
    assert kv_bytes_per_token(cfg, KVLayout("kivi2", 64, 64, exact_sink=True)) == 32 * 32 * (44 + 40)
    assert bytes_per_element(cfg, KVLayout("kivi2", 64, 64, exact_sink=True)) == Fraction(21, 64)  # 2.625 bits
    assert "exact sinks" in format_plan(cfg, KVLayout("kivi2", 64, 64, exact_sink=True), 1, 64)


def test_sequences_that_fit_hand_worked() -> None:
    cfg = model_shape("llama-2-7b")
    fit = sequences_that_fit(cfg, KVLayout("fp16", block_size=16), 80 * GiB, seq_len=1000)
    # A block is 16 tokens x 512 KiB = 8 MiB, so 80 GiB holds 10,240 blocks. A 1000-token
    # sequence takes ceil(1000 / 16) = 63 blocks: 10,240 // 63 = 162 sequences.
    assert fit.block_bytes == 8 * 2**20
    assert fit.num_blocks == 10_240
    assert fit.paged == 162
    # Contiguous reserves the model's 4096-token context: 4096 x 512 KiB = 2 GiB each -> 40.
    assert fit.contiguous == 40
    assert sequences_that_fit(cfg, KVLayout("fp16", block_size=16), 80 * GiB, 1000, max_len=1000).contiguous == 80 * GiB // (1000 * 524_288)
    with pytest.raises(ValueError, match="exceeds max_len"):
        sequences_that_fit(cfg, KVLayout("fp16", block_size=16), 80 * GiB, 5000)


def test_paging_waste_hand_worked() -> None:
    lengths = [1, 16, 17, 100]  # 134 tokens in all
    contiguous, paged = paging_waste(lengths, max_len=128, block_size=16)
    # Contiguous: 4 x 128 = 512 slots, 378 empty.
    assert contiguous == pytest.approx(378 / 512)
    # Paged: 16 + 16 + 32 + 112 = 176 slots, 42 empty.
    assert paged == pytest.approx(42 / 176)
    with pytest.raises(ValueError, match=r"\[1, 128\]"):
        paging_waste([129], max_len=128, block_size=16)


def test_lognormal_lengths_are_seeded_and_bounded() -> None:
    lengths = lognormal_lengths(500, median=300, sigma=0.8, max_len=2048, seed=1)
    assert lengths == lognormal_lengths(500, median=300, sigma=0.8, max_len=2048, seed=1)
    assert 1 <= min(lengths) and max(lengths) <= 2048
    contiguous, paged = paging_waste(lengths, 2048, 16)
    assert paged < contiguous


def test_attention_kinds_side_by_side() -> None:
    kinds = {k.name: k for k in compare_attention_kinds(model_shape("llama-3-8b"))}
    assert {n: k.kv_heads for n, k in kinds.items()} == {"MHA": 32, "GQA": 8, "MQA": 1}
    # MHA: 2 x 32 x 32 x 128 x 2 = 524,288; GQA is 4x smaller, MQA 32x.
    assert kinds["MHA"].bytes_per_token == 524_288
    assert kinds["MHA"].bytes_per_token == 4 * kinds["GQA"].bytes_per_token == 32 * kinds["MQA"].bytes_per_token
    # GPT-3 is MHA: its GQA form gets 8 KV heads, 12x smaller; MQA is 96x smaller.
    gpt3 = {k.name: k.bytes_per_token for k in compare_attention_kinds(model_shape("gpt3-175b"))}
    assert gpt3 == {"MHA": 4_718_592, "GQA": 4_718_592 // 12, "MQA": 4_718_592 // 96}
    # Falcon-7B's 71 heads have no grouping from 2 to 8, so only MHA and MQA are shown.
    falcon = {k.name: k.bytes_per_token for k in compare_attention_kinds(model_shape("falcon-7b"))}
    assert falcon == {"MHA": 2 * 32 * 71 * 64 * 2, "MQA": 8_192}


def test_config_json_file_and_directory(tmp_path: Path) -> None:
    expected = PRESETS["llama-3-8b"]
    (tmp_path / "config.json").write_text(json.dumps(expected.to_hf_dict()))
    assert model_shape(tmp_path / "config.json") == expected
    assert model_shape(str(tmp_path)) == expected
    with pytest.raises(FileNotFoundError, match="not a preset"):
        model_shape(tmp_path / "missing")
    (tmp_path / "config.json").write_text(json.dumps({"n_layer": 32}))
    with pytest.raises(ValueError, match="not a Llama-style"):
        model_shape(tmp_path)


def test_gguf_metadata_gives_the_shape() -> None:
    from kvserve.model.loader import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError:
        pytest.skip("the bundled SmolLM2 GGUF is not installed")
    cfg = model_shape(path)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert kv_bytes_per_token(cfg, KVLayout("fp16")) == 23_040


def test_explicit_shape_through_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert kv_bytes_per_token(explicit_shape(layers=80, kv_heads=8, head_dim=128, heads=64), KVLayout("fp16")) == 327_680
    main(["--layers", "80", "--kv-heads", "8", "--heads", "64", "--head-dim", "128", "--seq-len", "4096",
          "--budget", "80GiB", "--compare-attention", "--lengths-median", "500"])
    out = capsys.readouterr().out
    assert "KV per token: 327,680 bytes (320.00 KiB)" in out
    # 80 GiB / (16 x 327,680) = 16,384 blocks; 4096 tokens take 256 blocks -> 64 sequences.
    assert "paged:      64 (16,384 blocks of 16 tokens, 256 blocks each)" in out
    assert "GQA" in out and "<- this model" in out and "Waste over 1,000 sequences" in out


def test_format_plan_is_human_readable() -> None:
    text = format_plan(model_shape("gpt3-175b"), KVLayout("fp16"), 1, 2048, name="gpt3-175b")
    assert "KV cache: 9,663,676,416 bytes (9.00 GiB)" in text


@pytest.mark.parametrize(("dtype", "torch_dtype"),
                         [("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_planner_matches_the_engines_pool(dtype: str, torch_dtype: torch.dtype) -> None:
    cfg = PRESETS["tiny"]
    num_blocks, block_size = 3, 16
    pool = KVPool(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, torch_dtype,
                  torch.device("cpu"))
    assert pool.nbytes == kv_bytes_per_token(cfg, KVLayout(dtype)) * num_blocks * block_size
    assert KVPool.bytes_per_block(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim,
                                  torch_dtype) == kv_bytes(cfg, KVLayout(dtype), 1, block_size)


def test_a_per_layer_plan_is_priced_layer_by_layer(tmp_path: Path) -> None:
    from kvserve.cache.kv_plan import KVPlan

    cfg = model_shape("tiny")  # 2 layers, 2 KV heads, head_dim 16
    path = tmp_path / "plan.json"
    KVPlan((("int8", "int8"), ("auto", "int4"))).save(path)
    # Per KV head: int8 16 B + 2 B scale for K and V (36 B); bf16 keys 32 B; int4 g32 over 16 channels
    # is refused, so group 16: 8 B + 4 B. Layers: 36 + (32 + 12) = 80 B per head, 2 heads.
    assert kv_bytes_per_token(cfg, KVLayout(f"plan:{path}", group_size=16)) == 2 * 80
    KVPlan((("int8", "int8"),)).save(path)
    with pytest.raises(ValueError, match="names 1 layers, the model has 2"):
        kv_bytes_per_token(cfg, KVLayout(f"plan:{path}"))


def test_a_tensor_parallel_plan_prices_one_rank(capsys: pytest.CaptureFixture[str]) -> None:
    """SmolLM2's 3 KV heads over 2 ranks: rank 0 holds 2, so per token 30 layers x 2 (K, V) x
    2 heads x 64 x 2 bytes = 15,360 bytes, against 23,040 for the whole model."""
    main(["--preset", "smollm2-135m", "--tensor-parallel-size", "2", "--dtype", "fp16"])
    out = capsys.readouterr().out
    assert "rank 0 holds 2 KV head(s)" in out and "KV per token: 15,360 bytes" in out
    main(["--preset", "llama-3-8b", "--tensor-parallel-size", "16"])  # 8 KV heads over 16 ranks
    out = capsys.readouterr().out
    assert "replicated on 2 ranks" in out and "KV per token: 16,384 bytes" in out  # 32 x 2 x 1 x 128 x 2


@pytest.mark.parametrize("argv, message", [
    # The defaults (--seq-len 2048) against the preset's 512 tokens: the error named no option.
    (["--preset", "tiny", "--budget", "1GiB"], "--seq-len 2048 exceeds --max-len 512"),
    (["--config", "{notes}"], "--config {notes}: not a model's config"),  # was "Expecting value: ..."
    (["--gguf", "{notes}"], "--gguf {notes}: not a model's GGUF"),        # was "GGUF magic invalid"
])
def test_bad_planner_input_names_the_option(argv: list[str], message: str, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model\n")
    with pytest.raises(SystemExit) as exit_:
        main([a.format(notes=notes) for a in argv])
    assert str(exit_.value).startswith(f"kvserve memory: error: {message.format(notes=notes)}")


@pytest.mark.parametrize("sigma", ["nan", "-2"])
def test_a_length_spread_that_is_not_a_number_above_zero_is_a_usage_error(
        sigma: str, capsys: pytest.CaptureFixture[str]) -> None:
    # nan drew lengths of -2**63, -2 reached numpy's "sigma < 0".
    with pytest.raises(SystemExit) as exit_:
        main(["--preset", "tiny", "--lengths-median", "100", "--lengths-sigma", sigma])
    assert exit_.value.code == 2 and "argument --lengths-sigma: must be a number >= 0" in capsys.readouterr().err
