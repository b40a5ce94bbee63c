"""Whether `kvserve doctor`'s performance section agrees with `kvserve bench scaling` on the same
engine: `python benchmarks/doctor_vs_bench.py [repeats]`.

One stream decoding after a 96-token prompt of the bundled text, bf16. The bench times each
token as a client streaming it sees it (`bench.scaling.time_per_token`); the doctor times
`engine.step()` and splits it with torch.profiler (`diagnostics.performance.decode_profile`).
The two alternate, so that drift of this shared machine hits both alike.
"""
from __future__ import annotations

import statistics
import sys

from kvserve import LLM
from kvserve.bench.scaling import time_per_token
from kvserve.diagnostics.performance import decode_profile
from kvserve.texts import load_text


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    llm = LLM(kv_cache_memory="256MiB", max_model_len=2048)
    prompt = llm.tokenizer.encode(load_text(None, max_chars=4000).text, add_special_tokens=False)[:96]
    print("| run | bench scaling ms/token | doctor decode step ms | doctor / bench | doctor split (ms) |")
    print("|---|---|---|---|---|")
    ratios = []
    for run in range(repeats):
        # Tokens 2..33: the same contexts (97-128) the doctor's 20 steps cover after its warm-up.
        bench = statistics.median(time_per_token(llm, prompt, 33, "bench")[1:]) * 1e3
        doctor = decode_profile(llm, 1, prompt, steps=20)
        ratios.append(doctor["step_ms"] / bench)
        split = ", ".join(f"{k} {v:.2f}" for k, v in doctor["split_ms"].items())
        print(f"| {run + 1} | {bench:.2f} | {doctor['step_ms']:.2f} | {ratios[-1]:.3f} | {split} |", flush=True)
    print(f"\ndoctor / bench: median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}")


if __name__ == "__main__":
    main()
