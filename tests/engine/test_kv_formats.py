"""Generation end to end with compressed KV pages, on the tiny random model (head_dim 16, so
group-wise formats use groups of 16)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention.backend import AttentionBackend
from kvserve.attention.metadata import StepMetadata
from kvserve.attention.torch_sdpa import TorchSDPABackend
from kvserve.cache.formats import format_names, make_format
from kvserve.cache.kv_pool import KVPool
from kvserve.cache.quantized_pool import QuantizedKVPool
from kvserve.config import CHUNKED_BATCHED_TOKENS, EngineConfig
from kvserve.eval.quality import forced_logprobs
from tests.backend_cases import backend_device, heavy_case
from tests.conftest import CALM, TINY

# Every test also runs in a pool that preempts (tests/conftest.py, forced_preemption).
pytestmark = pytest.mark.forced_preemption

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8] * 5, [9, 10, 11], [1, 2, 3, 4, 5, 6, 7, 8] * 5 + [12, 13]]
GROUP = 16


def budget(fmt: str, blocks: int, residual: int, max_num_seqs: int, **fmt_kw: Any) -> str:
    """Bytes for exactly `blocks` compressed blocks plus the staging the pool will reserve."""
    k, v = (make_format(fmt, role, group_size=GROUP, **fmt_kw) for role in "kv")
    block = QuantizedKVPool.bytes_per_block(16, TINY.num_kv_heads, TINY.head_dim, [(k, v)] * TINY.num_layers)
    staging = QuantizedKVPool.staging_slots(max_num_seqs, 16, residual, [(k, v)], CHUNKED_BATCHED_TOKENS["cpu"])
    dense = KVPool.bytes_per_block(TINY.num_layers, 16, TINY.num_kv_heads, TINY.head_dim, torch.float32)
    return str(blocks * block + staging * dense)


def generates_under_pressure(llm: LLM) -> None:
    """An engine of 9 blocks runs PROMPTS to the end: someone is preempted, a prefix is reused."""
    assert llm.engine.block_manager.num_blocks == 9
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [24] * 3
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.prefix_stats.cached_tokens > 0


@pytest.mark.parametrize("fmt", [f for f in format_names() if f != "fp32"])
def test_every_format_generates_with_prefix_caching_and_preemption(tiny_llm: Callable[..., LLM], fmt: str) -> None:
    # 9 blocks of 16 tokens cannot hold three sequences of 40-66 tokens at once: someone is
    # preempted. The third prompt shares its first two blocks with the first (a prefix-cache hit).
    llm = tiny_llm(kv_cache_dtype=fmt, kv_group_size=GROUP, kv_residual=16, max_num_seqs=3,
                   kv_cache_memory=budget(fmt, 9, residual=16, max_num_seqs=3))
    generates_under_pressure(llm)


def test_residual_covering_the_context_equals_the_dense_cache(tiny_llm: Callable[..., LLM]) -> None:
    """With every token inside the full-precision window the int4 pages are never read, so the
    next-token distributions must be exactly the dense cache's; with no window they must not."""
    windows = [[(7 * i + 3 * j) % 128 for j in range(80)] for i in range(3)]

    def logprobs(**kwargs: object) -> torch.Tensor:
        return forced_logprobs(tiny_llm(max_num_seqs=3, **kwargs), windows, prefill_len=30)

    dense = logprobs()
    assert torch.equal(logprobs(kv_cache_dtype="int4", kv_group_size=GROUP, kv_residual=256), dense)
    assert (logprobs(kv_cache_dtype="int4", kv_group_size=GROUP) - dense).abs().max() > 1e-4


def test_same_budget_holds_more_tokens(tiny_llm: Callable[..., LLM]) -> None:
    dense = tiny_llm(kv_cache_memory="1MiB").engine
    int4 = tiny_llm(kv_cache_memory="1MiB", kv_cache_dtype="int4", kv_group_size=GROUP).engine
    # Per token and KV head: fp32 stores 16 dims * 4 B = 64 B; int4 g16 stores 8 B of codes and
    # one fp16 scale and zero-point (4 B) = 12 B.
    assert int4.kv_bytes_per_token == dense.kv_bytes_per_token * 12 / 64
    assert int4.block_manager.num_blocks == 2**20 // round(dense.kv_bytes_per_token * 12 / 64 * 16)
    # Keys in groups of 8 (8 B of codes + 2 x 4 B), values of 16 (12 B): 28 B where fp32 takes 128 B.
    roles = tiny_llm(kv_cache_memory="1MiB", kv_cache_dtype="int4", kv_group_size_k=8, kv_group_size_v=16).engine
    assert roles.kv_bytes_per_token == dense.kv_bytes_per_token * 28 / 128


@pytest.mark.parametrize("kwargs, field", [
    ({"kv_cache_dtype": "int3"}, "kv_cache_dtype"),
    ({"kv_cache_dtype_v": "nope"}, "kv_cache_dtype_v"),
    ({"kv_cache_dtype": "int8", "preemption_mode": "swap"}, "preemption_mode"),
    ({"kv_cache_dtype": "int8", "offload_memory": "1MiB"}, "offload_memory"),
    ({"kv_cache_dtype": "int4", "kv_group_size": 3}, "kv_group_size"),
    ({"kv_cache_dtype": "int4", "kv_group_size_v": 3}, "kv_group_size_v"),
    ({"kv_cache_dtype": "kivi4", "kv_group_size_v": 200}, "kv_group_size_v"),
    ({"kv_residual": -1}, "kv_residual"),
])
def test_bad_format_settings_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig.of(**kwargs)


def plan_file(tmp_path: Any, *layers: tuple[str, str]) -> str:
    from kvserve.cache.kv_plan import KVPlan

    path = tmp_path / "plan.json"
    KVPlan(tuple(layers)).save(path)
    return f"plan:{path}"


def test_a_uniform_plan_equals_the_format_and_each_layer_keeps_its_own(tiny_llm: Callable[..., LLM],
                                                                       tmp_path: Any) -> None:
    """A plan naming int8 for both layers is uniform int8, bit for bit. In a mixed plan each layer's
    pages are in its own format: layer 0's K/V do not depend on the cache, so its int4 fields equal
    those of a uniform int4 engine, and layer 1 holds plain fp32 pages."""
    windows = [[(7 * i + 3 * j) % 128 for j in range(60)] for i in range(2)]

    def run(**kwargs: Any) -> tuple[torch.Tensor, LLM]:

        # The same 12 blocks whatever the format, so that both engines hand out the same block ids.
        config = EngineConfig.of(model=TINY, dtype="float32", max_num_seqs=2, kv_group_size=GROUP, **kwargs)
        llm = tiny_llm(max_num_seqs=2, kv_group_size=GROUP, kv_cache_memory=str(config.kv_sizes(TINY).memory_for(12)),
                       **kwargs)
        return forced_logprobs(llm, windows, prefill_len=30), llm

    uniform, _ = run(kv_cache_dtype="int8")
    planned, _ = run(kv_cache_dtype=plan_file(tmp_path, ("int8", "int8"), ("int8", "int8")))
    assert torch.equal(planned, uniform)
    _, int4 = run(kv_cache_dtype="int4")
    mixed_out, mixed = run(kv_cache_dtype=plan_file(tmp_path, ("int4", "int4"), ("auto", "auto")))
    dense, _ = run()
    layer0, layer1 = mixed.engine.pool.kv
    assert [f.name for f in layer0.formats] == ["int4", "int4"] and [f.name for f in layer1.formats] == ["fp32"] * 2
    for got, want in zip(layer0.fields, int4.engine.pool.kv[0].fields):
        for name in want:
            assert torch.equal(got[name], want[name])
    assert layer1.fields[0]["data"].dtype == torch.float32
    # Compressing one layer of two costs less than compressing both, and more than none.
    err_one, err_all = (mixed_out - dense).abs().mean(), (run(kv_cache_dtype="int4")[0] - dense).abs().mean()
    assert 0 < err_one < err_all
    # Per token and KV head: int4 g16 12 B for K and for V in layer 0, fp32 64 B each in layer 1.
    assert mixed.engine.kv_bytes_per_token == TINY.num_kv_heads * (2 * 12 + 2 * 64)


def test_a_mixed_plan_survives_preemption_prefix_caching_and_leaks_nothing(tiny_llm: Callable[..., LLM],
                                                                          tmp_path: Any) -> None:
    from kvserve.config import EngineConfig

    plan = plan_file(tmp_path, ("kivi4", "int8"), ("auto", "int4"))
    config = EngineConfig.of(model=TINY, dtype="float32", kv_cache_dtype=plan, kv_group_size=GROUP, kv_residual=16,
                          max_num_seqs=3)
    memory = str(config.kv_sizes(TINY).memory_for(9))
    llm = tiny_llm(kv_cache_dtype=plan, kv_group_size=GROUP, kv_residual=16, max_num_seqs=3, kv_cache_memory=memory)
    generates_under_pressure(llm)


def test_a_plan_for_another_layer_count_names_the_field(tiny_llm: Callable[..., LLM], tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="KVFormatOptions.kv_cache_dtype: the plan names 3 layers, the model has 2"):
        tiny_llm(kv_cache_dtype=plan_file(tmp_path, *[("int8", "int8")] * 3))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_backends_read_a_mixed_plan_as_the_reference_does(tiny_llm: Callable[..., LLM], tmp_path: Any,
                                                          backend: str) -> None:
    plan = plan_file(tmp_path, ("int4", "int8"), ("auto", "fp8_e4m3"))
    windows = [[(5 * i + 3 * j + j * j) % 128 for j in range(70)] for i in range(3)]
    want = forced_logprobs(tiny_llm(max_num_seqs=3, kv_cache_dtype=plan, kv_group_size=GROUP,
                                    attention_backend="torch", cpu_kernels=False), windows, prefill_len=30)
    got = forced_logprobs(tiny_llm(max_num_seqs=3, kv_cache_dtype=plan, kv_group_size=GROUP,
                                   attention_backend=backend), windows, prefill_len=30)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_per_head_fp8_scales_are_the_calibration_texts_maxima(tiny_llm: Callable[..., LLM]) -> None:
    """The scales an engine calibrates at start-up equal the maxima a plain fp32 engine stores
    for the same tokens, read from its own pages after an ordinary prefill."""
    from kvserve.engine.kv_calibration import calibration_tokens

    llm = tiny_llm(kv_cache_dtype="fp8_e4m3", kv_fp8_scales="head", kv_calibration_tokens=100)
    ids = calibration_tokens(None, TINY.vocab_size, 100, seed=0, data="calibration")
    dense = tiny_llm()
    dense.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)
    # The finished prompt's blocks stay cached, in allocation order: blocks 0.. hold tokens 0..
    for layer, (k, v) in zip(llm.engine.pool.kv, dense.engine.pool.layers):
        for fmt, pages in zip(layer.formats, (k, v)):
            want = pages.flatten(0, 1)[:100].abs().amax((0, 2)) / torch.finfo(torch.float8_e4m3fn).max
            torch.testing.assert_close(fmt.head_scale, want, rtol=1e-5, atol=0)
    assert llm.engine.kv_bytes_per_token == TINY.num_layers * 2 * TINY.num_kv_heads * TINY.head_dim  # 1 B per value


class BesideTheReference:
    """An engine's attention backend with the torch backend (the reference) reading the same pages
    after each of its layer calls: the same queries over the pages as the backend left them, its
    writes and seals done (the reference writes nothing). Both read the same codes whatever the
    model's rounding put in them, so only the backends' reads can differ.

    Comparing two engines' logprobs instead (the reference one with eager ops and torch linears)
    measures the model's rounding as much as the reads: K and V a few ulps apart (the fused ops,
    the C++ linears, or another backend's attention in an earlier layer) put the odd value on the
    other side of a rounding boundary, and in this sharp model that one value moves logprobs far
    more than any tolerance for the reads. Measured on an AMD EPYC (AVX-512 BF16): K 1.6e-6 apart
    (relative) with the C++ ops on; one fp8 code of layer 1 at x / scale = 67.999998 against
    68.0001 (the tie between codes 64 and 72) moved logprobs by 1.1e-2, three fp16 exact sinks
    one ulp apart by 1.6e-3."""

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend
        self.reference = TorchSDPABackend(backend.pool, backend.num_heads, backend.softcap)
        self.reads: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (layer, backend's, reference's)

    @classmethod
    def install(cls, llm: LLM) -> "BesideTheReference":
        beside = cls(llm.engine.runner.backend)
        llm.engine.runner.backend = beside  # type: ignore[assignment]
        return beside

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def prepare(self, step: StepMetadata) -> tuple[Any, Any]:
        return self.backend.prepare(step), self.reference.prepare(step)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: tuple[Any, Any],
                scale: float) -> torch.Tensor:
        own, ref = meta
        out = self.backend.forward(layer, q, k, v, own, scale)
        kv = self.backend.pool.kv[layer]
        with mock.patch.object(kv, "write"), mock.patch.object(kv, "seal"):
            want = self.reference.forward(layer, q, k, v, ref, scale)
        self.reads.append((layer, out.clone(), want))
        return out

    def assert_same_reads(self) -> None:
        assert {layer for layer, _, _ in self.reads} == set(range(TINY.num_layers))
        for _, got, want in self.reads:
            # Measured: 2.7e-6 at most (fp32 summation order) on outputs up to 5.7.
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", heavy_case("triton", backend="triton")])
def test_backends_read_per_head_fp8_pages_as_the_reference_does(tiny_llm: Callable[..., LLM], backend: str) -> None:
    windows = [[(5 * i + 3 * j + j * j) % 128 for j in range(70)] for i in range(3)]
    kwargs = {"max_num_seqs": 3, "kv_cache_dtype": "fp8_e4m3", "kv_fp8_scales": "head", "kv_rotation": "hadamard"}
    llm = tiny_llm(**kwargs, attention_backend=backend, device=backend_device(backend))
    beside = BesideTheReference.install(llm)
    got = forced_logprobs(llm, windows, prefill_len=30)
    beside.assert_same_reads()
    dense = forced_logprobs(tiny_llm(max_num_seqs=3), windows, prefill_len=30)
    per_token = forced_logprobs(tiny_llm(**{**kwargs, "kv_fp8_scales": "token"}), windows, prefill_len=30)
    # Quantized, and about as close as a scale per token gets (measured: 0.145 against 0.115 mean).
    assert 0 < (got - dense).abs().mean() < 1.5 * (per_token - dense).abs().mean()


def test_per_head_fp8_generates_with_prefix_caching_and_preemption(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm(kv_cache_dtype="fp8_e5m2", kv_fp8_scales="head", max_num_seqs=3,
                   kv_cache_memory=str(9 * 16 * TINY.num_layers * 2 * TINY.num_kv_heads * TINY.head_dim))
    generates_under_pressure(llm)


@pytest.mark.parametrize("kwargs, field", [
    ({"kv_fp8_scales": "tensor"}, "kv_fp8_scales"),
    ({"kv_cache_dtype": "fp8_e4m3", "kv_fp8_scales": "head", "kv_calibration_tokens": 0}, "kv_calibration_tokens"),
    ({"kv_cache_dtype": "fp8_e4m3", "kv_fp8_scales": "head", "kv_calibration_data": "/no/such.txt"},
     "kv_calibration_data"),
])
def test_bad_fp8_scale_settings_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig.of(**kwargs)


@pytest.mark.parametrize("backend", ["cpu", heavy_case("triton", backend="triton")])
def test_exact_sink_kivi_reads_the_same_on_every_backend(tiny_llm: Callable[..., LLM], backend: str) -> None:
    windows = [[(5 * i + 3 * j + j * j) % 128 for j in range(70)] for i in range(3)]
    kwargs = {"max_num_seqs": 3, "kv_cache_dtype": "kivi2", "kv_residual": 0, "kv_exact_sink": True,
              "kv_group_size": GROUP}
    llm = tiny_llm(**kwargs, attention_backend=backend, device=backend_device(backend))
    beside = BesideTheReference.install(llm)
    got = forced_logprobs(llm, windows, prefill_len=30)
    beside.assert_same_reads()
    plain = forced_logprobs(tiny_llm(**{**kwargs, "kv_exact_sink": False}), windows, prefill_len=30)
    # The sinks are read, not ignored: ignored, the same codes would give the same logprobs.
    assert (got - plain).abs().max() > 1e-4


def test_exact_sink_kivi_generates_with_prefix_caching_and_preemption(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm(kv_cache_dtype="kivi2", kv_exact_sink=True, kv_group_size=GROUP, kv_residual=16, max_num_seqs=3,
                   kv_cache_memory=budget("kivi2", 9, residual=16, max_num_seqs=3, exact_sink=True))
    generates_under_pressure(llm)


def test_bad_exact_sink_names_the_field() -> None:
    with pytest.raises(ValueError, match="kv_exact_sink"):
        EngineConfig.of(kv_cache_dtype="kivi2", kv_exact_sink="yes")


def test_wide_key_channels_are_calibrated_at_start_up_and_bring_pages_closer(tiny_llm: Callable[..., LLM]) -> None:
    """kv_key_wide_channels: each layer's keys get whole RoPE pairs (d, d + D/2) per KV head,
    chosen at start-up; the bit they add brings forced logprobs closer to dense pages (values kept
    exact: in this random model 2-bit values' error dwarfs the keys')."""
    windows = [[(5 * i + 3 * j + j * j) % 128 for j in range(70)] for i in range(3)]
    common = {"max_num_seqs": 3, "kv_cache_dtype": "kivi2", "kv_cache_dtype_v": "fp32", "kv_residual": 0,
              "kv_exact_sink": True, "kv_group_size": GROUP}
    dense = forced_logprobs(tiny_llm(max_num_seqs=3), windows, prefill_len=30)
    plain = forced_logprobs(tiny_llm(**common), windows, prefill_len=30)
    llm = tiny_llm(**common, kv_key_wide_channels=8)
    half = TINY.head_dim // 2
    for kv in llm.engine.pool.kv:
        chosen = kv.formats[0].wide_channels
        assert chosen.shape == (TINY.num_kv_heads, 8)
        for head in chosen.tolist():
            low = [c for c in head if c < half]
            assert [c - half for c in head if c >= half] == low and len(low) == 4
    wide = forced_logprobs(llm, windows, prefill_len=30)
    assert (wide - dense).abs().mean() < 0.9 * (plain - dense).abs().mean()  # measured: 0.81


def test_the_2bit_layout_generates_with_prefix_caching_and_preemption(tiny_llm: Callable[..., LLM]) -> None:
    """Wide key channels, symmetric values rotated alone, exact sinks: the pool holds exactly the
    blocks its bytes buy, and preemption and prefix hits run over them without a leak."""
    fmt_kw = {"exact_sink": True, "key_wide_channels": 8, "symmetric_values": True}
    llm = tiny_llm(kv_cache_dtype="kivi2", kv_exact_sink=True, kv_key_wide_channels=8, kv_symmetric_values=True,
                   kv_rotation="hadamard", kv_rotate_keys=False, kv_group_size=GROUP, kv_residual=16,
                   max_num_seqs=3, kv_cache_memory=budget("kivi2", 9, residual=16, max_num_seqs=3, **fmt_kw))
    generates_under_pressure(llm)


@pytest.mark.parametrize("kwargs, field", [
    ({"kv_key_wide_channels": 12}, "kv_key_wide_channels"),
    ({"kv_key_wide_channels": "8"}, "kv_key_wide_channels"),
    ({"kv_symmetric_values": "yes"}, "kv_symmetric_values"),
    ({"kv_rotate_keys": None}, "kv_rotate_keys"),
])
def test_bad_2bit_layout_settings_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig.of(kv_cache_dtype="kivi2", **kwargs)


def test_the_2bit_layout_in_bf16_reads_the_same_on_the_cpu_kernel(tiny_llm: Callable[..., LLM]) -> None:
    """The C++ kernel's 16-wide KIVI decoders round through bf16 as the reference does: the same
    logprobs as the torch backend within bf16 attention noise."""
    windows = [[(5 * i + 3 * j + j * j) % 128 for j in range(70)] for i in range(3)]
    kwargs = {"dtype": "bfloat16", "max_num_seqs": 3, "kv_cache_dtype": "kivi2", "kv_residual": 0,
              "kv_exact_sink": True, "kv_key_wide_channels": 8, "kv_symmetric_values": True, "kv_group_size": GROUP}
    # The calm model: in bf16 the sharp one turns attention's rounding into flipped 2-bit codes.
    want = forced_logprobs(tiny_llm(**kwargs, model=CALM, attention_backend="torch"), windows, prefill_len=30)
    got = forced_logprobs(tiny_llm(**kwargs, model=CALM, attention_backend="cpu"), windows, prefill_len=30)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)  # other layouts move it 0.06-0.08
