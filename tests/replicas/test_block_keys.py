"""What the router and the replicas agree on, without Ray: block keys and merged metrics."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from kvserve import LLM, SamplingParams
from kvserve.replicas.block_keys import block_key, matched_blocks, prompt_block_keys
from kvserve.replicas.metrics_merge import merge_metrics


def test_prompt_keys_are_the_keys_a_replica_caches(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm()
    prompt = [(3 * j + 1) % 128 for j in range(70)]
    for salt in (None, "tenant-a"):
        llm.engine.add_request(prompt, SamplingParams(max_tokens=1), cache_salt=salt)
        while llm.engine.has_unfinished():
            llm.engine.step()
        keys = prompt_block_keys(prompt, 16, salt)
        assert len(keys) == 4  # full blocks before the last token
        assert set(keys) <= {block_key(h) for h in llm.engine.block_manager.cache}
    assert set(prompt_block_keys(prompt, 16)).isdisjoint(prompt_block_keys(prompt, 16, "tenant-a"))


def test_a_match_is_a_prefix_run() -> None:
    assert matched_blocks(["a", "b", "c"], {"a", "b"}) == 2
    assert matched_blocks(["a", "b", "c"], {"b", "c"}) == 0  # a later block without its parent serves nothing
    assert matched_blocks([], {"a"}) == 0


def test_merged_metrics_label_every_sample_with_its_replica() -> None:
    page = ("# HELP kvserve_prompt_tokens_total prompt tokens admitted\n# TYPE kvserve_prompt_tokens_total counter\n"
            "kvserve_prompt_tokens_total {}\n# HELP kvserve_requests sequences by scheduler state\n"
            "# TYPE kvserve_requests gauge\nkvserve_requests{{state=\"running\"}} {}\n")
    merged = merge_metrics({"r1": page.format(10.0, 2.0), "r2": page.format(5.0, 0.0)}).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(merged) for s in f.samples}
    assert samples[("kvserve_prompt_tokens_total", (("replica", "r1"),))] == 10.0
    assert samples[("kvserve_prompt_tokens_total", (("replica", "r2"),))] == 5.0
    assert samples[("kvserve_requests", (("replica", "r1"), ("state", "running")))] == 2.0
    assert merged.count("# TYPE kvserve_requests gauge") == 1
    assert "# TYPE kvserve_prompt_tokens_total counter" in merged  # the text format names counters with _total
