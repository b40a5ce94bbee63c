"""Validation of EngineConfig and SamplingParams, and parse_bytes.

Every rejection must be a ValueError whose message names the offending field, so a user who
passes a bad value learns which one from the message alone.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from kvserve.config import EngineConfig, parse_bytes
from kvserve.model.config import ModelConfig
from kvserve.sampling_params import SamplingParams


@pytest.mark.parametrize("field,value", [
    ("dtype", "float64"),
    ("dtype", "int8"),
    ("device", "gpu"),
    ("device", "tpu:0"),
    # Starts with "cuda" but is no device string torch accepts (torch.device raises later).
    ("device", "cuda:x"),
    ("device", "cudafoo"),
    ("cache_mode", "paged-ish"),
    ("cache_mode", "none"),
    ("block_size", 0),
    ("block_size", -16),
    ("block_size", 16.0),
    ("max_num_seqs", 0),
    ("max_num_seqs", "32"),
    ("max_num_batched_tokens", 0),
    ("max_model_len", 0),
    ("max_model_len", -1),
    ("max_model_len", 2048.5),
    ("kv_cache_memory", 1.5),
    ("kv_cache_memory", 0.0),
    ("kv_cache_memory", -0.5),
    # An int is a number just like a float (kv_budget_bytes multiplies it by free memory), so
    # 2 means 200% of free memory and 0 means an empty cache; both must be rejected.
    ("kv_cache_memory", 2),
    ("kv_cache_memory", 0),
    ("kv_cache_memory", "lots"),
    ("kv_cache_memory", "2XB"),
    ("kv_cache_memory", ""),
    ("kv_cache_memory", "-1GiB"),
    # Matches the number pattern [0-9.]+ but is not a number: float() fails inside parse_bytes.
    ("kv_cache_memory", "1.2.3GiB"),
    ("kv_cache_memory", ".GiB"),
    # The KV format settings are checked whatever the formats (here the default, uncompressed).
    ("kv_group_size", 3),
    ("kv_outliers", 0),
    ("kv_sparse_threshold", "high"),
    ("kv_sparse_capacity", 1.5),
    ("kv_fp8_scales", "tensor"),
    ("kv_key_wide_channels", 12),
    ("kv_key_wide_channels", False),  # a flag is no count
    ("kv_outliers", True),
    # Every field is checked against its annotated type: a word is no flag, a flag no number.
    ("cuda_graphs", "no"),
    ("cpu_fused_step", "off"),
    ("kv_cache_memory", True),
    ("kv_cache_memory", [1]),
    ("seed", "x"),
    ("kv_remote_timeout", True),
    ("kv_remote_timeout", float("nan")),
    ("host_swap_memory", 5),
])
def test_engine_config_rejects(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig.of(**{field: value})


@pytest.mark.parametrize("mode", ["contiguous", "no-cache"])
@pytest.mark.parametrize("owner, field, value", [("EngineConfig", "preemption_mode", "swap"),
                                                 ("EngineConfig", "preemption_mode", "auto"),
                                                 ("CacheOptions", "offload_memory", "1MiB")])
def test_the_baselines_refuse_what_only_paged_blocks_do(mode: str, owner: str, field: str, value: str) -> None:
    # These were accepted and did nothing: a baseline has no block tables to swap or offload.
    with pytest.raises(ValueError, match=f"^{owner}.{field}.*cache_mode='paged'"):
        EngineConfig.of(cache_mode=mode, **{field: value})


def test_model_dependent_settings_name_the_field() -> None:
    model = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                        num_kv_heads=1, head_dim=16, max_position=128)
    EngineConfig.of(kv_cache_dtype="int4", kv_group_size=16, max_model_len=128).check_model(model)
    for kwargs, message in [({"max_model_len": 129}, r"EngineConfig.max_model_len \(129\) exceeds"),
                            ({"kv_cache_dtype": "int4"}, r"EngineConfig.kv_group_size \(32\) must divide"),
                            ({"kv_cache_dtype": "int4", "kv_group_size": 8, "kv_group_size_v": 32},
                             r"EngineConfig.kv_group_size_v \(32\) must divide")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig.of(**kwargs).check_model(model)


def test_engine_config_accepts_good_values() -> None:
    # The counterpart of the rejections: boundary values that must pass.
    for kwargs in [{}, {"dtype": "fp32", "device": "cpu"},
                   {"cache_mode": "contiguous"}, {"cache_mode": "no-cache"},
                   {"block_size": 1, "max_num_seqs": 1, "max_model_len": 1, "max_num_batched_tokens": 1},
                   {"kv_cache_memory": 1.0}, {"kv_cache_memory": 0.01}, {"kv_cache_memory": "512MiB"}]:
        EngineConfig.of(**kwargs)


def test_kv_budget_bytes_from_string() -> None:
    assert EngineConfig.of(kv_cache_memory="3GiB").kv_budget_bytes() == 3 * 2**30


@pytest.mark.parametrize("text,expected", [
    ("2GiB", 2 * 2**30),
    ("512MiB", 512 * 2**20),
    ("1.5GB", 1_500_000_000),
    ("64KiB", 64 * 1024),
    ("10kb", 10_000),
    ("2 gib", 2 * 2**30),   # units are case-insensitive and may follow a space
    ("4096", 4096),         # bare number: bytes
    ("100B", 100),
    ("0.5MiB", 2**19),
    ("100TiB", 100 * 2**40),
    ("1PiB", 2**50),
    ("2TB", 2 * 10**12),
    ("1pb", 10**15),
])
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["2EiB", "GiB", "two GiB", "1.2.3GiB", "."])
def test_parse_bytes_rejects_with_field_name(text: str) -> None:
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_bytes(text)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2.0),
    ("temperature", -0.1),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.2),
    ("top_k", -1),
])
def test_sampling_params_rejects(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field,value", [("stop", ["\n"]), ("stop_token_ids", [2])])
def test_beam_search_rejects_stops(field: str, value: object) -> None:
    """Beam hypotheses end on EOS or length only: a stop would be silently ignored."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(beam_width=2, **{field: value})


def test_sampling_params_rejects_empty_stop() -> None:
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["ok", ""])


def test_sampling_params_boundaries_and_normalisation() -> None:
    p = SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, stop="END")
    assert p.greedy
    assert p.stop == ["END"]  # a single stop string becomes a list
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-5).greedy  # vLLM's 1e-5
    SamplingParams(top_p=1e-9, top_k=1)


def test_a_cuda_device_that_is_not_there_is_refused_naming_the_field() -> None:
    # It used to pass, and the model load died with "Torch not compiled with CUDA enabled".
    beyond = f"cuda:{torch.cuda.device_count()}"
    devices = [beyond] if torch.cuda.is_available() else ["cuda", "cuda:0", beyond]
    for device in devices:
        with pytest.raises(ValueError, match=f"^ModelOptions.device is '{device}' but"):
            EngineConfig.of(device=device)


def test_a_request_budget_without_eviction_is_refused() -> None:
    config = EngineConfig()
    assert config.eviction_policy(None, None, owner="SamplingParams") is None
    for name in (None, "none"):  # the engine's "none", or the request's own
        with pytest.raises(ValueError, match="^SamplingParams.kv_budget has no effect without kv_eviction"):
            config.eviction_policy(name, 8, owner="SamplingParams")
    assert config.eviction_policy("window", 8, owner="SamplingParams").budget == 8


@pytest.mark.parametrize("field", ["host_swap_memory", "disk_swap_memory", "offload_memory"])
@pytest.mark.parametrize("value", [0, 1024, 1.5])
def test_a_size_given_as_a_number_says_what_a_size_is(field: str, value: object) -> None:
    # It said "must be str": a bare number is refused (vLLM's swap_space counts GiB, our
    # kv_cache_memory takes a fraction), saying what to write instead.
    with pytest.raises(ValueError, match=f"^CacheOptions.{field} must be a size string such as '4GiB', '512MiB' "
                                         f"or '0', got {value} of type {type(value).__name__}$"):
        EngineConfig.of(**{field: value})


def test_a_swap_dir_that_is_no_directory_is_refused_naming_it(tmp_path: Path) -> None:
    # It was a bare NotADirectoryError / FileNotFoundError once the engine made the swap file.
    file = tmp_path / "file"
    file.write_text("")
    for path, why in ((file, "is not a writable directory"), (tmp_path / "missing", "does not exist")):
        with pytest.raises(ValueError, match=f"^CacheOptions.swap_dir: {re.escape(repr(str(path)))} {why}$"):
            EngineConfig.of(preemption_mode="swap", disk_swap_memory="1MiB", swap_dir=str(path))
    EngineConfig.of(preemption_mode="swap", disk_swap_memory="1MiB", swap_dir=str(tmp_path))


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swap_tiers_that_hold_no_block_are_refused(mode: str) -> None:
    """Swap asked for, but neither tier holds one KV block (2048 bytes here): every preemption
    recomputed without a word. Refused once the model's block size is known."""
    model = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                        num_kv_heads=1, head_dim=16, max_position=128)
    with pytest.raises(ValueError, match=r"^EngineConfig.host_swap_memory \(1KiB\) and disk_swap_memory \(0\) hold "
                                         r"no KV block \(2048 bytes for this model\)"):
        EngineConfig.of(preemption_mode=mode, host_swap_memory="1KiB").check_model(model)
    for kwargs in ({"host_swap_memory": "2KiB"}, {"host_swap_memory": "1KiB", "disk_swap_memory": "2KiB"},
                   {"preemption_mode": "recompute", "host_swap_memory": "0"}):
        EngineConfig.of(**{"preemption_mode": mode, **kwargs}).check_model(model)


def test_every_option_has_one_part_and_flat_names_round_trip() -> None:
    from kvserve.config import PARTS, option_fields
    listed = [f.name for cls in PARTS.values() for f in option_fields(cls)]
    assert len(listed) == len(set(listed))  # a name in two parts could not be given flat
    config = EngineConfig.of(block_size=32, kv_cache_dtype="int8", max_num_seqs=4, kv_eviction="window", kv_budget=64)
    assert (config.cache.block_size, config.kv_format.kv_cache_dtype, config.scheduler.max_num_seqs,
            config.eviction.kv_budget) == (32, "int8", 4, 64)
    assert EngineConfig.of(**config.options()) == config
    assert config.replace(block_size=8).cache.block_size == 8 and config.replace(block_size=8).scheduler == \
        config.scheduler
    with pytest.raises(TypeError, match="unknown option.*blok_size"):
        EngineConfig.of(blok_size=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache.block_size = 8  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, field", [
    ({"block_size": 0}, "block_size"), ({"kv_cache_dtype": "int3"}, "kv_cache_dtype"),
    ({"kv_group_size": 3, "kv_cache_dtype": "int4"}, "kv_group_size"),
    ({"kv_group_size_v": 3, "kv_cache_dtype": "int4"}, "kv_group_size_v"),
    ({"kv_eviction": "window"}, "kv_budget"), ({"kv_eviction": "snapkv", "kv_budget": 64, "kv_pooling_kernel": 4},
                                               "kv_pooling_kernel"),
    ({"kv_cache_dtype": "plan:"}, "kv_cache_dtype"), ({"host_swap_memory": "lots"}, "host_swap_memory")])
def test_config_errors_carry_the_field(kwargs: dict, field: str) -> None:  # type: ignore[type-arg]
    """The error names its field in a form callers read without parsing (FieldError.field), and the
    message names it too."""
    from kvserve.validate import FieldError
    with pytest.raises(FieldError) as caught:
        EngineConfig.of(**kwargs)
    assert caught.value.field == field and field in str(caught.value)


def test_a_role_group_size_is_checked_where_a_format_uses_it() -> None:
    # Pages in the model dtype use no groups: the option waits for a format, as before the split.
    assert EngineConfig.of(kv_group_size_k=3).kv_format.kv_group_size_k == 3
    with pytest.raises(ValueError, match="^KVFormatOptions.kv_group_size_k must be an integer from 4 to 128"):
        EngineConfig.of(kv_cache_dtype="int4", kv_group_size_k=3)
