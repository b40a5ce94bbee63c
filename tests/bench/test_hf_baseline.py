import pytest
import torch

from kvserve.bench.hf_baseline import load_hf_model, run_hf_static_batches
from kvserve.model.loader import default_model_path
from kvserve.bench.workload import WorkloadRequest


@pytest.mark.slow
def test_static_batches_timings_are_ordered() -> None:
    model, tokenizer = load_hf_model(str(default_model_path()), torch.float32)
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
    requests = [
        WorkloadRequest(tokenizer.encode(p, add_special_tokens=False), max_tokens=m)
        for p, m in zip(prompts, (3, 5, 2))
    ]
    timings, wall_s = run_hf_static_batches(
        model, requests, batch_size=2, pad_token_id=tokenizer.pad_token_id, progress=False
    )

    assert [t.output_len for t in timings] == [3, 5, 2]
    assert [t.prompt_len for t in timings] == [len(r.prompt_token_ids) for r in requests]
    t0 = timings[0].arrival
    assert all(t.arrival == t0 for t in timings)
    assert all(t.arrival < t.first_token < t.finish for t in timings)
    # The first batch shares its prefill; the shorter request finishes first.
    assert timings[0].first_token == timings[1].first_token
    assert timings[0].finish < timings[1].finish
    # The second batch only starts once the first has run all 5 steps.
    assert timings[2].first_token > timings[1].finish
    assert wall_s >= timings[2].finish - t0


@pytest.mark.slow
def test_the_cached_hf_reading_of_the_gguf_equals_transformers_reading_it_again() -> None:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    cached, _ = load_hf_model(str(path), torch.float32)
    direct = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                  local_files_only=True)
    want, got = direct.state_dict(), cached.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert cached.lm_head.weight is cached.model.embed_tokens.weight
