"""Decode steps from CUDA graphs give what the eager step gives: the static buffers and pad rows
on any device (the same step function run without capture, Triton interpreted on the CPU), the
captured graphs themselves when a GPU is present."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.step_plan import plan_step
from kvserve.engine.cuda_graphs import DecodeGraphs
from tests.backend_cases import NO_TRITON

PROMPTS = [[3, 4, 5, 6, 7], list(range(10, 47)), [9] * 20]


@NO_TRITON
@pytest.mark.parametrize("max_batch,rotation", [(3, "none"), (5, "none"), (8, "hadamard")],
                         ids=["no-pad", "pad", "pad-rotated"])
def test_static_decode_step_equals_the_eager_step(tiny_llm: Callable[..., LLM], max_batch: int,
                                                  rotation: str) -> None:
    """Three sequences in decode; the step run from the static buffers (padded to the bucket)
    gives the eager step's logits and leaves the pages as the eager step wrote them."""
    if torch.cuda.is_available():
        pytest.skip("the uncaptured step is the CPU check; the CUDA test below captures")
    llm = tiny_llm(attention_backend="triton", max_num_seqs=max_batch, kv_rotation=rotation)
    engine, runner = llm.engine, llm.engine.runner
    ids = [engine.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in PROMPTS]
    for _ in range(3):  # prefill, then two decode steps
        engine.step()
    batch = engine.scheduler.schedule()
    assert batch.num_scheduled == [1, 1, 1]
    step = runner.prepare(plan_step(batch, engine.block_manager, engine.pool, engine.device))
    want = runner.execute(step).logits
    pages = [t.clone() for t in runner.pool.block_tensors]
    graphs = DecodeGraphs(runner.model, runner.backend, runner.ops, runner.rotation, max_batch,
                          engine.max_model_len, runner.device, capture=False)
    assert graphs.serves(step.metadata, len(step.rows))
    got = graphs.run(step.metadata, torch.tensor(step.input_ids))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Not bit-equal: a padded batch runs its matmuls at another row count, and some BLAS builds
    # (MKL on AMD CPUs, for one) then round a row differently. A K/V row in the wrong slot, or a
    # pad row writing over a live one, would move a page by O(1), far beyond this tolerance.
    for before, after in zip(pages, runner.pool.block_tensors):
        torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    for rid in ids:
        engine.abort(rid)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_rotation", ["none", "hadamard"])
def test_graphed_engine_gives_the_eager_tokens(tiny_llm: Callable[..., LLM], kv_rotation: str) -> None:
    """Greedy and seeded sampling, batches of 1..6 (buckets with and without pad rows), prompts
    that finish at different steps: the same tokens with and without CUDA graphs."""
    prompts = PROMPTS + [list(range(1, 90)), [7, 8], [5] * 33]
    params = [SamplingParams(max_tokens=12 + 9 * i, ignore_eos=True, temperature=0.8 * (i % 2), seed=i)
              for i in range(len(prompts))]

    def run(graphs: bool) -> list[list[int]]:
        llm = tiny_llm(device="cuda", attention_backend="triton", max_num_seqs=6, cuda_graphs=graphs,
                       kv_rotation=kv_rotation)
        assert (llm.engine.runner.graphs is not None) == graphs
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    assert run(True) == run(False)
