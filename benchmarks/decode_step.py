"""Quiet single-stream decode step time of the bundled model: `python benchmarks/decode_step.py ROOT CTX [MODEL]`.

ROOT is a kvserve source tree (this one, or a worktree of an older commit) so that two builds can be
alternated in one session on a host whose speed drifts; CTX is the prompt length. Prints the median
and the 10th percentile of 300 greedy `engine.step()` calls after 20 warm-up steps. MODEL: a
`--model` value (default: the bundled one), e.g. gemma3-270m.
"""

import statistics
import sys
import time

STEPS = 300
WARMUP = 20


def main(root: str, context: int, model: str | None) -> None:
    sys.path.insert(0, root)
    from kvserve import LLM, SamplingParams

    engine = LLM(model=model).engine
    params = SamplingParams(max_tokens=STEPS + WARMUP + 20, temperature=0.0, ignore_eos=True)
    engine.add_sequence(engine.make_sequence(list(range(100, 100 + context)), params))
    for _ in range(WARMUP):
        engine.step()
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    times.sort()
    print(f"{root} ctx={context} median={statistics.median(times) * 1e3:.2f}ms p10={times[STEPS // 10] * 1e3:.2f}ms")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
