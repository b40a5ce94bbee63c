"""Mixed-workload throughput with oneDNN's row counts bounded (cpu_linear.ROW_BUCKET = 64) and
not (1), alternating in one process: `python benchmarks/onednn_rows_ab.py`."""
from __future__ import annotations

import random
import time

import kvserve.model.cpu_linear as cpu_linear
from kvserve import LLM, SamplingParams


def main() -> None:
    llm = LLM(kv_cache_memory="512MiB", max_model_len=2048)
    rng = random.Random(0)
    requests = [([rng.randrange(100, 5000) for _ in range(int(rng.lognormvariate(5, 0.6)))], rng.randint(8, 64))
                for _ in range(48)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in requests]

    def tok_s() -> float:
        start = time.perf_counter()
        outs = llm.generate([p for p, _ in requests], params, use_tqdm=False)
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)

    tok_s()  # warm-up
    for _ in range(2):
        for bucket in (1, 64):
            cpu_linear.ROW_BUCKET = bucket
            print(f"ROW_BUCKET {bucket}: {tok_s():.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
