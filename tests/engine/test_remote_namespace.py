"""Two engines share a remote block only if every byte of its pages would be the same: each
setting that shapes pages changes the namespace."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from kvserve.cache.formats.block_rope import BlockRope
from kvserve.cache.formats.vector import VectorFormat, load_codebook
from kvserve.config import EngineConfig
from kvserve.engine.kv_calibration import KVStats, calibrate_formats
from kvserve.engine.remote_namespace import remote_namespace

LAYERS, KV_HEADS, DIM = 2, 2, 16
MODEL = torch.nn.Linear(2, 2)  # one model throughout: its weights are part of the name


def stats_of(importance: torch.Tensor) -> KVStats:
    angles = BlockRope(torch.ones(16, DIM // 2), torch.zeros(16, DIM // 2))
    return KVStats(torch.ones(LAYERS, 2, KV_HEADS), importance, torch.zeros(LAYERS, KV_HEADS, DIM),
                   torch.ones(LAYERS, KV_HEADS, DIM), torch.zeros(LAYERS, KV_HEADS, DIM, DIM), importance,
                   (angles,) * LAYERS)


def namespace(sign: float = 1.0, **kw: Any) -> str:
    """The namespace of a kivi engine with `kw` changed; `sign` -1 calibrates other wide channels."""
    config = EngineConfig.of(**{"kv_cache_dtype": "kivi2", "kv_group_size": 16, **kw})
    formats = config.kv_layer_formats(LAYERS)
    importance = sign * torch.arange(LAYERS * KV_HEADS * DIM, dtype=torch.float32).reshape(LAYERS, KV_HEADS, DIM)
    return remote_namespace(MODEL, config, calibrate_formats(formats, stats_of(importance)))


@pytest.mark.parametrize("change", [
    {"kv_exact_sink": True}, {"kv_symmetric_values": True}, {"kv_key_wide_channels": 8},
    {"kv_rotation": "hadamard"}, {"kv_group_size": 8}, {"kv_cache_dtype": "kivi4"},
])
def test_every_page_setting_changes_the_namespace(change: dict[str, Any]) -> None:
    assert namespace(**change) != namespace()


def test_rotating_values_alone_and_other_wide_channels_are_other_pages() -> None:
    assert namespace(kv_rotation="hadamard", kv_rotate_keys=False) != namespace(kv_rotation="hadamard")
    assert namespace(kv_key_wide_channels=8) == namespace(kv_key_wide_channels=8)
    assert namespace(-1.0, kv_key_wide_channels=8) != namespace(kv_key_wide_channels=8)


def test_mixed_keys_with_other_bits_per_channel_are_other_pages() -> None:
    config = EngineConfig.of(kv_cache_dtype="kivi2_mix", kv_group_size=16, kv_key_wide_channels=8)

    def mixed(importance: torch.Tensor) -> str:
        return remote_namespace(MODEL, config, calibrate_formats(config.kv_layer_formats(LAYERS), stats_of(importance)))

    rising = torch.arange(LAYERS * KV_HEADS * DIM, dtype=torch.float32).reshape(LAYERS, KV_HEADS, DIM) ** 4
    assert mixed(rising) == mixed(rising.clone())
    assert mixed(rising) != mixed(rising.flip(-1))  # the same bits, on other channels
    assert mixed(rising) != namespace(kv_key_wide_channels=8)


def test_fitted_keys_with_other_channel_spreads_are_other_pages() -> None:
    """int8_fit divides each key channel by its calibrated spread before the codes: blocks encoded
    with one spread decode wrongly with another, even where the offset and weights agree."""
    config = EngineConfig.of(kv_cache_dtype="int8_fit")

    def fitted(spread: torch.Tensor) -> str:
        stats = dataclasses.replace(stats_of(torch.ones(LAYERS, KV_HEADS, DIM)), key_spread=spread)
        return remote_namespace(MODEL, config, calibrate_formats(config.kv_layer_formats(LAYERS), stats))

    spread = torch.linspace(0.5, 4.0, LAYERS * KV_HEADS * DIM).reshape(LAYERS, KV_HEADS, DIM)
    assert fitted(spread) == fitted(spread.clone())
    assert fitted(spread) != fitted(spread.flip(-1))


def test_vector_values_with_another_codebook_are_other_pages() -> None:
    """A vector format's codes index its codebook: blocks coded against one decode wrongly with another."""
    config = EngineConfig.of(kv_cache_dtype="kivi2", kv_cache_dtype_v="kivi2_vq")
    formats = config.kv_layer_formats(LAYERS)

    def coded_with(book: torch.Tensor) -> str:
        return remote_namespace(MODEL, config, [(k, VectorFormat("kivi2_vq", book)) for k, _ in formats])

    shipped = load_codebook()
    assert coded_with(shipped) == remote_namespace(MODEL, config, formats)
    assert coded_with(shipped) != coded_with(-shipped)
