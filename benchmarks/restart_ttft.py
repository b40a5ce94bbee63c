"""TTFT of a long shared prompt after a restart, with and without the disk tier (issue 45).

Each round: a first process serves the prompt (its blocks join the prefix cache, and with
`kv_disk_dir` the disk), exits; a second process, started fresh on the same directory, times the
first token of the same prompt with another question after it. Without the tier the second
process prefills it all again. Rounds alternate the two configurations; medians reported.

    python benchmarks/restart_ttft.py --prompt-tokens 2048 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
from kvserve import LLM, SamplingParams
from kvserve.texts import load_text
args = json.loads(sys.argv[1])
options = {"max_model_len": args["max_model_len"]}
if args["disk"]:
    options["kv_disk_dir"] = args["disk"]
llm = LLM(**options)
ids = llm.tokenizer.encode(load_text("python-docs").text[:40000])[:args["prompt_tokens"]]
question = llm.tokenizer.encode(" Question " + str(args["question"]) + ": what is described above?")
start = time.perf_counter()
out = llm.generate(ids + question, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
ttft = out.first_token_time - out.arrival_time
llm.engine.close()
print(json.dumps({"ttft_s": ttft, "cached": out.num_cached_tokens, "prompt": len(ids + question)}))
"""


def run(options: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(options)], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    results: dict[str, list[dict]] = {"no tier": [], "kv_disk_dir": []}
    for r in range(args.rounds):
        for name in results:
            with tempfile.TemporaryDirectory() as disk:
                base = {"prompt_tokens": args.prompt_tokens, "max_model_len": args.prompt_tokens + 64,
                        "disk": disk if name == "kv_disk_dir" else None}
                run({**base, "question": 0})           # the first process: computes, writes the disk
                results[name].append(run({**base, "question": r + 1}))  # the restarted one, timed
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]['ttft_s']:.3f} s (cached {v[-1]['cached']})"
                                              for n, v in results.items()), flush=True)
    med = {n: statistics.median(x["ttft_s"] for x in v) for n, v in results.items()}
    print(f"\n| after a restart | TTFT (median of {args.rounds}) | prompt tokens | cached tokens |\n|---|---|---|---|")
    for n, v in results.items():
        print(f"| {n} | {med[n]:.3f} s | {v[-1]['prompt']} | {v[-1]['cached']} |")
    print(f"\nkv_disk_dir: **{med['no tier'] / med['kv_disk_dir']:.1f}x** faster first token")


if __name__ == "__main__":
    main()
