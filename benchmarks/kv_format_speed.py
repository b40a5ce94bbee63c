"""A KV format's prefill and 8-row decode speed on the bundled model, bf16:
`python benchmarks/kv_format_speed.py ROOT FORMAT [FORMAT ...]`.

ROOT is a kvserve source tree (this one, or a worktree of an older commit) so that two builds can be
alternated on a host whose speed drifts. For each `kv_cache_dtype` FORMAT, one engine (8 sequences at
most, no prefix cache) takes 8 prompts of 400 seeded random tokens: the engine steps until every
prompt is in its pages (timed: the prefill), then 64 decode steps of 8 rows, each timed. Prints the
attention backend the engine picked, the prefill's time and the decode steps' median.
"""

import statistics
import sys
import time

PROMPTS, PROMPT_LEN, DECODE = 8, 400, 64


def main(root: str, names: list[str]) -> None:
    sys.path.insert(0, root)
    import numpy as np

    from kvserve import LLM, SamplingParams

    for name in names:
        engine = LLM(max_num_seqs=PROMPTS, dtype="bfloat16", kv_cache_dtype=name, enable_prefix_caching=False).engine
        rng = np.random.default_rng(0)
        params = SamplingParams(max_tokens=DECODE + 8, ignore_eos=True, temperature=0)
        for _ in range(PROMPTS):
            engine.add_request([int(t) for t in rng.integers(100, 40000, PROMPT_LEN)], params)
        start = time.perf_counter()
        while engine.scheduler.waiting or any(s.num_computed_tokens < PROMPT_LEN for s in engine.scheduler.running):
            engine.step()
        prefill = time.perf_counter() - start
        steps = []
        for _ in range(DECODE):
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
        while engine.has_unfinished():
            engine.step()
        backend = type(engine.runner.backend).__name__
        print(f"{name}: {backend}; prefill {PROMPTS} x {PROMPT_LEN} tokens {prefill * 1e3:.0f} ms; "
              f"decode {statistics.median(steps) * 1e3:.1f} ms a step ({PROMPTS} rows, median of {DECODE})")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
