"""A decode beside named neighbours: `python benchmarks/shared_machine.py --sets quiet,busy6,omp2`.

One measured process (the bundled model, loaded and warmed up first) streams `--tokens` greedy
tokens, alone and then beside each set of neighbour processes. For each set the table gives the
quiet time, the contended time, and the fair-share time: what the measured process would take
if it got exactly its share of the cores, quiet x (its threads + the neighbours' runnable
threads) / cores, with the neighbours' runnable threads counted from /proc while it runs (a
thread spinning in an OpenMP barrier counts: it holds a core as a busy loop does; each is
weighted by its nice value as the scheduler weighs it).

Neighbours (each its own process, started before the measured decode and killed after):
- busyN: N Python busy loops (one runnable thread each);
- ompN: N processes each timing small torch matmuls on 2 threads with OpenMP's default wait
  policy, so hundreds of short parallel regions a second whose threads spin between them (an
  engine or an evaluation of another project);
- buildN: N loops of `g++ -O2` compiling a C++ file (a build: short processes, disk, memory);
- engine: a second kvserve engine decoding a long stream in a loop;
- heavy: build2 + omp1 + busy2 (what the collapse was first seen beside);
- niceN: ompN at `nice -n 19` (a background job started politely). The scheduler shares a core by
  weight, so a neighbour thread counts toward the fair share by its nice weight (nice 19: 15/1024).
`--env K=V` sets a variable in the measured process only (e.g. OMP_WAIT_POLICY=ACTIVE).
`--prompt-tokens N` makes the prompt N token ids, prefilled cold every time (prefix caching off):
with `--tokens 1` the time is a prefill's (e.g. `--prompt-tokens 512 --tokens 1`).
"""
from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CORES = len(os.sched_getaffinity(0))

MEASURE = r"""
import json, sys, time
from kvserve import LLM, SamplingParams
tokens, prompt_tokens = int(sys.argv[1]), int(sys.argv[2])
llm = LLM(kv_cache_memory="256MiB", max_model_len=2048, enable_prefix_caching=prompt_tokens == 0)
params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
warm = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
prompt = list(range(100, 100 + prompt_tokens)) if prompt_tokens else "Tell me a story about a lighthouse keeper."
llm.generate(prompt, warm, use_tqdm=False)
print("ready", flush=True)
sys.stdin.readline()
start = time.perf_counter()
n = sum(1 for _ in llm.stream(prompt, params))
wall = time.perf_counter() - start
import torch
from kvserve.kernels import cpu_extension
kernels = cpu_extension.load()
stats = getattr(kernels, "thread_pool_stats", None)  # None: kernels on OpenMP (before the pool)
pool = stats() if stats is not None else {}
print(json.dumps({"seconds": wall, "steps": n, "threads": torch.get_num_threads(), "pool": pool}), flush=True)
"""

OMP_LOOP = r"""
import torch
torch.set_num_threads(2)
a, b = torch.randn(64, 256), torch.randn(256, 256)
while True:
    for _ in range(1000):
        a = torch.tanh(a @ b)
"""

ENGINE_LOOP = r"""
from kvserve import LLM, SamplingParams
llm = LLM(kv_cache_memory="256MiB", max_model_len=2048)
while True:
    llm.generate("Write a long essay about the sea.", SamplingParams(max_tokens=512, ignore_eos=True),
                 use_tqdm=False)
"""

CPP = r"""
#include <map>
#include <regex>
#include <string>
#include <vector>
#include <algorithm>
std::map<std::string, std::vector<int>> f(const std::string& s) {
  std::map<std::string, std::vector<int>> m; std::regex r("[a-z]+");
  for (auto it = std::sregex_iterator(s.begin(), s.end(), r); it != std::sregex_iterator(); ++it) m[it->str()].push_back(1);
  return m;
}
int main() { return static_cast<int>(f("abc def").size()); }
"""


def neighbours(name: str, workdir: Path) -> list[list[str]]:
    """The commands of a neighbour set."""
    py = sys.executable
    if name == "quiet":
        return []
    if name == "engine":
        return [[py, "-c", ENGINE_LOOP]]
    if name == "heavy":
        return neighbours("build2", workdir) + neighbours("omp1", workdir) + neighbours("busy2", workdir)
    if name.startswith("nice") and name[4:].isdigit():
        return [["nice", "-n", "19", *cmd] for cmd in neighbours(f"omp{name[4:]}", workdir)]
    for kind in ("busy", "omp", "build"):
        if name.startswith(kind) and name[len(kind):].isdigit():
            count = int(name[len(kind):])
            if kind == "busy":
                return [[py, "-c", "while True: pass"]] * count
            if kind == "omp":
                return [[py, "-c", OMP_LOOP]] * count
            source = workdir / "unit.cpp"
            source.write_text(CPP)
            return [["bash", "-c", f"while true; do g++ -O2 -c {source} -o {workdir}/unit{i}.o; done"]
                    for i in range(count)]
    raise SystemExit(f"shared_machine: unknown neighbour set {name!r}")


def nice_weight(nice: int) -> float:
    """A thread's share of a core against a nice-0 thread's (the kernel's table: 1.25x a step)."""
    return 1.25 ** -nice


def runnable_threads(pids: list[int]) -> float:
    """Threads in state R among these processes and their descendants, now, weighted by nice."""
    seen, stack, count = set(), list(pids), 0.0
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        task = Path(f"/proc/{pid}/task")
        try:
            for tid in task.iterdir():
                stat = (tid / "stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
                count += nice_weight(int(fields[16])) if fields[0] == "R" else 0.0
                children = (tid / "children").read_text().split()
                stack.extend(int(c) for c in children)
        except OSError:
            continue
    return count


def measure(tokens: int, prompt_tokens: int, env: dict[str, str],
            neighbour_cmds: list[list[str]]) -> dict[str, float]:
    child_env = {**os.environ, **env}
    proc = subprocess.Popen([sys.executable, "-c", MEASURE, str(tokens), str(prompt_tokens)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=child_env)
    assert proc.stdout is not None and proc.stdin is not None
    while proc.stdout.readline().strip() != "ready":
        if proc.poll() is not None:
            raise SystemExit("shared_machine: the measured process failed")
    others = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for cmd in neighbour_cmds]
    try:
        time.sleep(5 if neighbour_cmds else 0)  # the neighbours load and reach their loops
        proc.stdin.write("go\n")
        proc.stdin.flush()
        samples: list[float] = []
        line = ""
        while not line:
            if others:
                samples.append(runnable_threads([o.pid for o in others]))
            if select.select([proc.stdout], [], [], 0.1)[0]:
                line = proc.stdout.readline()
        result = json.loads(line)
        result["neighbour_runnable"] = sum(samples) / len(samples) if samples else 0.0
        return result
    finally:
        for o in others:
            o.kill()
            o.wait()
        proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sets", default="busy2,busy6,omp2,build2,engine,heavy",
                   help="neighbour sets besides quiet, comma-separated")
    p.add_argument("--tokens", type=int, default=48, help="tokens the measured process streams")
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="a prompt of this many token ids, prefilled cold (0: a short text prompt)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds, each measuring quiet and then every set (medians reported)")
    p.add_argument("--env", action="append", default=[], help="K=V for the measured process (repeatable)")
    p.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = p.parse_args()
    env = dict(kv.split("=", 1) for kv in args.env)
    names = ["quiet", *[n for n in args.sets.split(",") if n and n != "quiet"]]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name in names:
                r = measure(args.tokens, args.prompt_tokens, env, neighbours(name, Path(tmp)))
                runs[name].append(r)
                print(f"round {round_ + 1} {name}: {r['seconds']:.2f} s, neighbours' runnable threads "
                      f"{r['neighbour_runnable']:.1f}, pool {r['pool']}", flush=True)
    quiet = statistics.median(r["seconds"] for r in runs["quiet"])
    threads = min(runs["quiet"][0]["threads"], CORES)
    rows = []
    for name in names:
        seconds = statistics.median(r["seconds"] for r in runs[name])
        runnable = statistics.median(r["neighbour_runnable"] for r in runs[name])
        fair = quiet * (threads + runnable) / CORES
        pool = [r["pool"] for r in runs[name] if r["pool"]]
        chunks = sum(q["caller_chunks"] + q["worker_chunks"] for q in pool)
        share = f"{100 * sum(q['worker_chunks'] for q in pool) / chunks:.0f}%" if chunks else "-"
        regions = sum(q["parallel_regions"] + q.get("solo_regions", 0) for q in pool)
        solo = f"{100 * sum(q.get('solo_regions', 0) for q in pool) / regions:.0f}%" if regions else "-"
        rows.append(f"| {name} | {runnable:.1f} | {seconds:.2f} | {fair:.2f} | {seconds / fair:.2f} | {share} "
                    f"| {solo} |")
    prompt = f"{args.prompt_tokens}-token prompt, " if args.prompt_tokens else ""
    head = [f"{prompt}{args.tokens} tokens, {CORES} cores, torch threads {threads}, medians of {args.rounds} rounds, "
            f"measured process env {env or '{}'}", "",
            "| neighbours | runnable neighbour threads | time (s) | fair-share time (s) | time / fair share "
            "| kernel chunks run by workers | regions run solo |", "|---|---|---|---|---|---|---|"]
    table = "\n".join(head + rows)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
