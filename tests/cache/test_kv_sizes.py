from kvserve.cache.kv_sizes import KVSizes
from kvserve.config import EngineConfig
from tests.conftest import TINY


def test_a_full_precision_pool_costs_its_k_and_v_elements_and_keeps_no_staging() -> None:
    sizes = EngineConfig.of(model=TINY, dtype="float32", block_size=16).kv_sizes(TINY)
    # K and V, per layer, block token and KV head: head_dim fp32 elements.
    assert sizes == KVSizes(2 * TINY.num_layers * 16 * TINY.num_kv_heads * TINY.head_dim * 4, 0, 0)
    assert sizes.memory_for(10) == 10 * sizes.block_bytes


def test_a_residual_window_keeps_full_precision_staging_slots_outside_the_blocks() -> None:
    config = EngineConfig.of(model=TINY, dtype="float32", kv_cache_dtype="kivi4", kv_group_size=16, max_num_seqs=3)
    sizes = config.kv_sizes(TINY)
    dense = EngineConfig.of(model=TINY, dtype="float32").kv_sizes(TINY).block_bytes
    assert 0 < sizes.block_bytes < dense
    assert sizes.staging_slots > 0 and sizes.staging_bytes == dense * sizes.staging_slots
    assert sizes.memory_for(7) == sizes.staging_bytes + 7 * sizes.block_bytes
