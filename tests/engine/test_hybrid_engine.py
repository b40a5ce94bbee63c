"""The hybrid KV cache on tiny random Gemma 3 and Mistral models (written by transformers): the
window changes memory only. Hybrid on and off give the same tokens and logprobs through chunked
prefill, prefix hits, forks and preemption; a long sequence's sliding groups hold the window's
blocks only; what the hybrid cache is not built for is refused naming the field."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Gemma3TextConfig, MistralConfig

from kvserve import LLM, SamplingParams
from kvserve.cache.kv_groups import NULL_BLOCK
from kvserve.server.kv_state import kv_state
from kvserve.server.metrics import Metrics
from kvserve.validate import FieldError
from tests.model.test_architectures import save_tiny

WINDOW, BLOCK = 8, 4
SHAPE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "max_position_embeddings": 512, "initializer_range": 0.2}
# Two sliding layers per global one, as Gemma 3's pattern in small: a full group and two sliding.
GEMMA = {**SHAPE, "num_hidden_layers": 6, "num_key_value_heads": 1, "head_dim": 32, "sliding_window": WINDOW,
         "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2}
PROMPTS = [[(7 * i + 3 * j) % 127 + 1 for i in range(5 * WINDOW + j)] for j in range(3)]
BASE = {"dtype": "float32", "device": "cpu", "block_size": BLOCK, "max_model_len": 256,
        "max_num_batched_tokens": 16, "max_num_seqs": 4, "kv_cache_memory": "2MiB"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid")
    save_tiny(Gemma3TextConfig(**GEMMA), root / "gemma3")
    save_tiny(MistralConfig(**SHAPE, num_hidden_layers=2, num_key_value_heads=2, sliding_window=WINDOW),
              root / "mistral")
    return {"gemma3": root / "gemma3", "mistral": root / "mistral"}


def _run(path: Path, prompts: list[list[int]], **kwargs: object) -> list[tuple[list[int], list[float]]]:
    llm = LLM(model=str(path), **{**BASE, **kwargs})
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]


def _assert_same(got: list[tuple[list[int], list[float]]], want: list[tuple[list[int], list[float]]]) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_hybrid_on_and_off_give_the_same_tokens_and_logprobs(models: dict[str, Path], family: str) -> None:
    """Prompts five windows long, 32 greedy tokens, in 16-token chunks; the second pass of the
    same prompts hits the prefix cache (hits equal misses)."""
    off = _run(models[family], PROMPTS, disable_hybrid_kv_cache=True)
    llm = LLM(model=str(models[family]), **BASE)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=1)
    for _ in range(2):
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        _assert_same([(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs], off)
    stats = llm.engine.block_manager.prefix_stats
    assert stats.cached_tokens > 0  # the second pass hit


def test_preemption_and_samples_keep_the_tokens(models: dict[str, Path]) -> None:
    """A pool so small that sequences are preempted (by recompute) gives the roomy pool's tokens;
    n = 2 samples fork every group's table and copy on write."""
    want = _run(models["gemma3"], PROMPTS, disable_hybrid_kv_cache=True)
    tight = LLM(model=str(models["gemma3"]), **{**BASE, "num_blocks_override": 40, "max_num_seqs": 3})
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=1)
    outs = tight.generate(PROMPTS, params, use_tqdm=False)
    _assert_same([(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs], want)
    assert tight.engine.scheduler.num_preemptions > 0
    sampled = LLM(model=str(models["gemma3"]), **BASE).generate(
        PROMPTS[:1], SamplingParams(n=2, max_tokens=16, temperature=0.8, seed=3, ignore_eos=True), use_tqdm=False)
    alone = [LLM(model=str(models["gemma3"]), **BASE, disable_hybrid_kv_cache=True).generate(
        PROMPTS[:1], SamplingParams(n=2, max_tokens=16, temperature=0.8, seed=3, ignore_eos=True), use_tqdm=False)]
    assert [o.token_ids for o in sampled] == [o.token_ids for o in alone[0]]


def test_a_long_sequence_holds_the_window_in_each_sliding_group(models: dict[str, Path]) -> None:
    """Decoded to ten windows: each sliding group's table holds at most window / block + 1 blocks
    (counted after every step), the full group every block."""
    llm = LLM(model=str(models["gemma3"]), **BASE)
    engine = llm.engine
    bm = engine.block_manager
    assert len(bm.specs) == 3 and bm.specs[0].window is None and bm.specs[1].window == WINDOW
    engine.add_request(list(range(1, 6)), SamplingParams(max_tokens=10 * WINDOW, temperature=0, ignore_eos=True),
                       request_id="long")
    most = 0
    while engine.has_unfinished():
        engine.step()
        if "long" in bm.tables:
            n = bm.num_tokens["long"]
            for g in (1, 2):
                held = [b for b in bm.group_tables[g]["long"] if b != NULL_BLOCK]
                assert len(held) <= WINDOW // BLOCK + 1
                most = max(most, len(held))
            assert len(bm.tables["long"]) == -(-n // BLOCK)
    assert most == WINDOW // BLOCK + 1
    assert bm.usage().used == 0


def test_the_same_budget_holds_more_sequences(models: dict[str, Path]) -> None:
    """A block holds 2 layers hybrid (6 with every layer full): three times the blocks, of which
    a long sequence takes a third plus the windows'."""
    on = LLM(model=str(models["gemma3"]), **BASE).engine
    off = LLM(model=str(models["gemma3"]), **BASE, disable_hybrid_kv_cache=True).engine
    layer_bytes = 2 * BLOCK * 1 * 32 * 4  # K and V of one layer's block: 1 KV head of 32, fp32
    assert on.block_manager.num_blocks == 2 * 2**20 // (2 * layer_bytes)
    assert off.block_manager.num_blocks == 2 * 2**20 // (6 * layer_bytes)
    # Bytes per token are every layer's, hybrid or not (eval and the doctor compare them).
    assert on.kv_bytes_per_token == off.kv_bytes_per_token == 6 * layer_bytes / BLOCK
    n = 200
    on_need = on.block_manager.blocks_held(n)
    assert on_need == -(-n // BLOCK) + 2 * ((n - 1) // BLOCK - (n - WINDOW) // BLOCK + 1)
    assert on.block_manager.capacity // on_need > 2 * (off.block_manager.capacity // -(-n // BLOCK))


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_pages_coded_token_by_token_share_the_groups_blocks(models: dict[str, Path], kv: str) -> None:
    """int8 and fp8 pages (one format for every layer, no staging) on the hybrid cache: the same
    tokens and logprobs as with every layer keeping every block; staging is refused."""
    want = _run(models["gemma3"], PROMPTS, kv_cache_dtype=kv, disable_hybrid_kv_cache=True)
    llm = LLM(model=str(models["gemma3"]), **BASE, kv_cache_dtype=kv)
    assert len(llm.engine.pool.kv) == 2  # a block holds one layer of each of the three groups' two
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=1)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    _assert_same([(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs], want)
    with pytest.raises(FieldError) as caught:
        LLM(model=str(models["gemma3"]), **BASE, kv_cache_dtype=kv, kv_residual=16)
    assert caught.value.field == "kv_cache_dtype"


@pytest.mark.parametrize("field, value", [("preemption_mode", "swap"), ("offload_memory", "1MiB"),
                                          ("kv_cache_dtype", "kivi4"), ("cache_mode", "contiguous")])
def test_what_the_hybrid_cache_is_not_built_for_is_refused(models: dict[str, Path], field: str,
                                                           value: str) -> None:
    with pytest.raises(FieldError) as caught:
        LLM(model=str(models["gemma3"]), **BASE, **{field: value})
    assert caught.value.field == field and "disable_hybrid_kv_cache" in str(caught.value)
    LLM(model=str(models["gemma3"]), **{**BASE, field: value, "disable_hybrid_kv_cache": True,
                                        "max_num_batched_tokens": 256})


@pytest.mark.parametrize("options", [{"kv_cache_dtype": "fp8_e4m3_fit"}, {"kv_cache_dtype": "int8_fit"},
                                     {"kv_cache_dtype": "fp8_e4m3", "kv_fp8_scales": "head"}])
def test_formats_calibrated_per_layer_are_refused(models: dict[str, Path], options: dict[str, str]) -> None:
    """A hybrid pool's page tensor holds one layer of every group, so it would encode every layer
    with one layer's calibration: refused, and each layer calibrated on its own without the
    hybrid cache."""
    with pytest.raises(FieldError) as caught:
        LLM(model=str(models["gemma3"]), **BASE, **options)
    assert caught.value.field == "kv_cache_dtype" and "calibrated per layer" in str(caught.value)
    llm = LLM(model=str(models["gemma3"]), **BASE, **options, disable_hybrid_kv_cache=True, kv_calibration_tokens=64)
    kv = llm.engine.pool.kv  # every layer's keys calibrated on its own
    assert len({id(layer.formats[0]) for layer in kv}) == len(kv) > 3


def test_metrics_and_the_dashboard_show_the_groups(models: dict[str, Path]) -> None:
    """Mid-decode, /metrics' per-group gauge and the dashboard's group list count each group's
    blocks as the tables hold them."""
    engine = LLM(model=str(models["gemma3"]), **BASE).engine
    engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    for _ in range(20):
        engine.step()
    metrics = Metrics()
    metrics.observe_gauges(engine)
    text = metrics.render().decode()
    held = engine.block_manager.group_blocks()
    assert held[0] == -(-engine.block_manager.num_tokens["0"] // BLOCK) and held[1] == held[2] <= WINDOW // BLOCK + 1
    for group, kind in enumerate(["full", f"window {WINDOW}", f"window {WINDOW}"]):
        assert f'kvserve_kv_group_blocks{{group="{group}",kind="{kind}"}} {float(held[group])}' in text
    state = kv_state(engine)
    assert [(g["kind"], g["blocks"]) for g in state["kv_cache_groups"]] == \
        [("full", held[0]), (f"window {WINDOW}", held[1]), (f"window {WINDOW}", held[2])]
    assert state["states"][0] == "N"
    while engine.has_unfinished():
        engine.step()


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_speculation_over_sliding_windows(models: dict[str, Path], family: str) -> None:
    """N-gram drafts verified and rolled back over the sliding groups (a rejected token's slot may
    sit past a window's edge): the tokens of the same engine without them, in a tight pool too."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(model=str(models[family]), **BASE).generate(PROMPTS, params, use_tqdm=False)]
    for extra in ({}, {"num_blocks_override": 40, "max_num_seqs": 3}):
        llm = LLM(model=str(models[family]), **{**BASE, **extra}, speculative="ngram", prompt_lookup_min=1)
        assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == want
        stats = llm.engine.update.verifier.stats
        assert 0 < stats.accepted_tokens < stats.draft_tokens, stats
