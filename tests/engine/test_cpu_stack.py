"""The decoder stack in one C++ call (engine/cpu_stack.py) gives the layered model's logits bit for
bit, on decode and mixed prefill + decode steps, and the same tokens through the engine's block
moves (prefix caching, n > 1, beams, preemption, host offload); configurations it cannot run fall
back to the layered model."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention import StepAttention
from kvserve.engine.step_plan import plan_step
from kvserve.engine.cpu_stack import CPUDecodeStack
from kvserve.kernels import cpu_extension
from kvserve.model.cpu_linear import kernel_layout
from tests.conftest import TINY

kernels = cpu_extension.load()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.has_bf16_gemm(),
                                reason="needs the CPU kernels with AVX512-BF16 or AVX2")

BF16 = {"dtype": "bfloat16", "attention_backend": "cpu"}


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("qkv_bias", [False, True], ids=["llama", "qwen2-bias"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3", "int4"])
def test_stack_step_equals_the_layered_step(tiny_llm: Callable[..., LLM], block_size: int, qkv_bias: bool,
                                            kv_cache_dtype: str) -> None:
    """Decode rows of ragged contexts beside a prefill chunk: the stack's logits equal the layered
    model's over the same pages, and its K/V writes (codes and scales, for compressed pages) equal
    the layered model's."""
    if kv_cache_dtype == "int4" and block_size == 1:
        pytest.skip("one block size is enough for the int4 encoder")
    llm = tiny_llm(model=replace(TINY, qkv_bias=qkv_bias), block_size=block_size, max_num_batched_tokens=16,
                   max_num_seqs=4, kv_cache_dtype=kv_cache_dtype, kv_group_size=8, **BF16)
    engine, runner = llm.engine, llm.engine.runner
    assert runner.stack is not None
    ids = [engine.add_request(list(range(5, 5 + n)), SamplingParams(max_tokens=30, ignore_eos=True))
           for n in (3, 11, 7)]
    for _ in range(6):
        engine.step()
    ids.append(engine.add_request(list(range(40, 80)), SamplingParams(max_tokens=30, ignore_eos=True)))
    batch = engine.scheduler.schedule()
    assert sorted(batch.num_scheduled)[:3] == [1, 1, 1] and max(batch.num_scheduled) > 1  # a mixed step
    step = runner.prepare(plan_step(batch, engine.block_manager, engine.pool, engine.device))
    input_ids = torch.tensor(step.input_ids)
    assert runner.stack.serves(step.metadata)
    pages = [t.clone() for t in runner.pool.block_tensors]
    got = runner.stack.run(step.metadata, input_ids, step.rows)
    written = [t.clone() for t in runner.pool.block_tensors]
    assert any(not torch.equal(a, b) for a, b in zip(pages, written))
    for t, before in zip(runner.pool.block_tensors, pages):
        t.copy_(before)
    with torch.inference_mode():
        want = runner.model(input_ids, StepAttention.of(runner.backend, step.metadata), step.rows, runner.ops)
    assert torch.equal(got, want)
    for after, stacked in zip(runner.pool.block_tensors, written):
        assert torch.equal(after, stacked)
    for rid in ids:
        engine.abort(rid)


@pytest.mark.parametrize("options", [
    {},
    {"enable_prefix_caching": True, "block_size": 4},
    {"kv_cache_memory": "48KiB", "preemption_mode": "recompute"},
    {"kv_cache_memory": "48KiB", "preemption_mode": "swap"},
    {"kv_cache_memory": "32KiB", "offload_memory": "1MiB", "enable_prefix_caching": False},
    {"kv_cache_dtype": "int8", "kv_cache_memory": "24KiB", "preemption_mode": "recompute"},
    {"kv_cache_dtype": "int4", "kv_group_size": 8, "enable_prefix_caching": True, "block_size": 4},
], ids=["plain", "prefix-cache", "recompute", "swap", "offload", "int8-recompute", "int4-prefix-cache"])
def test_engine_gives_the_layered_tokens(tiny_llm: Callable[..., LLM], options: dict) -> None:
    """Greedy, seeded, n > 1 and beam requests sharing a prefix, under preemption and offload:
    the same tokens and log-probabilities with the stack as without."""
    prefix = list(range(3, 40))
    prompts = [prefix + [50 + i] for i in range(3)] + [[9] * 20]
    params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0, logprobs=2),
              SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.9, seed=3, n=2),
              SamplingParams(max_tokens=12, ignore_eos=True, beam_width=2),
              SamplingParams(max_tokens=50, ignore_eos=True, temperature=0.7, seed=5)]
    if "offload_memory" in options:  # one long sequence, four times the device pool
        prompts, params = [prompts[0][:20]], [SamplingParams(max_tokens=230, temperature=0, ignore_eos=True)]

    def run(stack: bool) -> list:
        llm = tiny_llm(max_num_seqs=4, cpu_fused_step=stack, **BF16, **options)
        assert (llm.engine.runner.stack is not None) == stack
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.token_ids, o.logprobs) for o in outs]

    assert run(True) == run(False)


@pytest.mark.parametrize("options,reason", [
    ({"dtype": "float32"}, "bf16"),
    ({"kv_cache_dtype": "int8", "kv_residual": 16}, "no full-precision residual"),
    ({"kv_cache_dtype": "kivi4", "kv_group_size": 8}, "no full-precision residual"),
    ({"attention_backend": "torch"}, "the cpu attention backend"),
    ({"kv_rotation": "hadamard"}, "rotation"),
    # q, k and v of 16 + 1 + 1 heads of size 2: 36 outputs, which the AVX2 kernel pads to 48.
    ({"model": replace(TINY, num_heads=16, num_kv_heads=1, head_dim=2)}, "not a multiple of 16"),
    # Hidden size 48 is not a multiple of the kernels' k step (32): those linears fall back (the
    # stack was built and failed at the first step before).
    ({"model": replace(TINY, hidden_size=48, num_heads=3, num_kv_heads=1, intermediate_size=96)},
     "not a multiple of 32"),
], ids=["fp32", "int8-residual", "kivi-pages", "torch-backend", "rotation", "padded-outputs", "hidden-48"])
def test_configurations_the_stack_cannot_run_stay_layered(tiny_llm: Callable[..., LLM], options: dict,
                                                          reason: str, caplog: pytest.LogCaptureFixture) -> None:
    if reason == "not a multiple of 16" and not kernels.interleaves_bf16_weights():
        pytest.skip("only the AVX2 kernel pads weights")
    with caplog.at_level("INFO", logger="kvserve.engine.model_runner"):
        llm = tiny_llm(**{**BF16, **options})
    assert llm.engine.runner.stack is None
    assert reason in caplog.text
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4


def test_the_stack_refuses_a_weight_whose_outputs_do_not_match_its_layer(tiny_llm: Callable[..., LLM]) -> None:
    """Its own check, past Python's: 4 more q/k/v outputs than the layer has (on AVX2 padded to
    a whole group) would flow into RoPE and attention as extra heads' rows."""
    llm = tiny_llm(**BF16)
    runner = llm.engine.runner
    qkv = runner.model.model.layers[1].self_attn.qkv_proj
    rows, hidden = qkv.out_features, TINY.hidden_size
    qkv.weight = kernel_layout(torch.zeros(rows + 4, hidden, dtype=torch.bfloat16), kernels)
    with pytest.raises(RuntimeError, match=f"qkv weight reads {hidden} inputs into .* the layer needs "
                                           f"{hidden} into {rows}"):
        CPUDecodeStack(runner.model, runner.backend, kernels)
