"""The host's share of a decode step: `python benchmarks/host_overhead.py --batch 1 --layers 1`.

A tiny random model (hidden 64) on the CPU, so the kernels cost next to nothing and a step's
time is what the engine spends around them: scheduling, metadata, the layer loop, sampling,
bookkeeping. That is the floor a GPU step cannot go under without graphs (for the per-layer
part) or overlapping the host with the device (for the rest). The second figure is the host's
CPU time outside the model call (`ModelRunner.execute`): what even a graphed step leaves.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from kvserve import LLM, SamplingParams  # before torch: kvserve sets OpenMP's spin (threads.py)

import torch  # noqa: E402
from kvserve.model.config import ModelConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--async-scheduling", default="off", choices=("on", "off"),
                   help="on: the path a GPU takes by default (tokens read a step late)")
    p.add_argument("--output-kind", default="cumulative", choices=("cumulative", "final"),
                   help="final: LLM.generate's (no output object per sequence per step)")
    p.add_argument("--stages", action="store_true",
                   help="also time each stage of a step (the wrappers add ~20 us a step of their own)")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=args.layers, num_heads=4,
                        num_kv_heads=2, head_dim=16, max_position=4096)
    engine = LLM(model=model, dtype="float32", device="cpu", kv_cache_memory="256MiB", max_model_len=4096,
                 max_num_seqs=max(args.batch, 1), attention_backend="cpu",
                 async_scheduling=args.async_scheduling).engine
    for i in range(args.batch):
        engine.add_request([(7 * i + j) % 250 + 3 for j in range(100)],
                           SamplingParams(max_tokens=args.steps + 50, ignore_eos=True, temperature=0,
                                          output_kind=args.output_kind))
    for _ in range(20):  # prefill, then warm decode steps
        engine.step()
    # Host CPU time per stage of a step; "execute" is the model call (what a graph replaces).
    stages = {"schedule": (engine.scheduler, "schedule"), "prepare": (engine.runner, "prepare"),
              "execute": (engine.runner, "execute"), "complete_step": (engine.scheduler, "complete_step"),
              "sample": (engine.runner, "sample"), "read tokens": (engine, "_read_pending"),
              "prefix registration": (engine, "_register_blocks")}
    if not args.stages:
        stages = {"execute": stages["execute"]}
    spent = dict.fromkeys(stages, 0.0)
    for name, (owner, attr) in stages.items():
        setattr(owner, attr, timed(getattr(owner, attr), name, spent))
    start, start_cpu = time.perf_counter(), time.thread_time()
    for _ in range(args.steps):
        engine.step()
    wall, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
    print(f"batch {args.batch}, {args.layers} layer(s), async {args.async_scheduling}, {args.output_kind}: "
          f"{wall / args.steps * 1e3:.3f} ms a step; host CPU outside the model call "
          f"{(cpu - spent['execute']) / args.steps * 1e3:.3f} ms")
    if args.stages:
        print("  per stage, ms a step: " + ", ".join(f"{name} {t / args.steps * 1e3:.3f}" for name, t in spent.items()))


def timed(fn: Callable[..., Any], name: str, spent: dict[str, float]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        begin = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.thread_time() - begin
    return run


if __name__ == "__main__":
    main()
