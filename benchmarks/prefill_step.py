"""Quiet prefill time of the bundled model: `python benchmarks/prefill_step.py ROOT [TOKENS] [REPS]`.

ROOT is a kvserve source tree (this one, or a worktree of an older commit) so that two builds can be
alternated in one session on a host whose speed drifts, as benchmarks/decode_step.py does for
decode. Each rep prefills a TOKENS-token prompt (default 512) cold (prefix caching off) and samples
one token; after two warm-up reps it prints the median and the fastest of REPS (default 15), and
the median share of the machine's CPUs that other processes used during each rep (read from
/proc/stat, this process's own CPU time taken out), so reps run beside other work can be told apart.
`OMP_NUM_THREADS=1` measures one thread.
"""

import os
import statistics
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")
CPUS = len(os.sched_getaffinity(0))


def busy_seconds() -> float:
    """CPU seconds every process has run since boot (/proc/stat: all but idle and iowait)."""
    fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / TICK


def main(root: str, tokens: int, reps: int) -> None:
    sys.path.insert(0, root)
    from kvserve import LLM, SamplingParams  # before torch: kvserve sets OpenMP's spin (threads.py)
    import torch

    engine = LLM(enable_prefix_caching=False).engine
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = list(range(100, 100 + tokens))

    def prefill() -> tuple[float, float]:
        busy, own, start = busy_seconds(), time.process_time(), time.perf_counter()
        engine.add_sequence(engine.make_sequence(prompt, params))
        while engine.has_unfinished():
            engine.step()
        wall = time.perf_counter() - start
        others = (busy_seconds() - busy - (time.process_time() - own)) / (wall * CPUS)
        return wall, max(0.0, others)

    prefill(), prefill()
    runs = [prefill() for _ in range(reps)]
    times = sorted(t for t, _ in runs)
    others = statistics.median(o for _, o in runs)
    print(f"{root} tokens={tokens} threads={torch.get_num_threads()} median={statistics.median(times):.3f}s "
          f"min={times[0]:.3f}s others={others:.2f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 512, int(sys.argv[3]) if len(sys.argv) > 3 else 15)
