"""`kvserve bench spec`: one CPU stream with and without n-gram speculation, on three tasks
(copying a paragraph with corrections, summarizing a document, open-ended chat), beside
llama.cpp's own prompt lookup decoding (llama-cpp-python's `LlamaPromptLookupDecoding`) on the
same bf16 weights, and a mixed batch of all three with speculation on and off.

A row times the decode (first token to last, prefill apart: it is the same on and off) of a
greedy answer that stops at EOS or `--max-tokens`; kvserve's tokens are the same on and off
(checked), so the ratio is of the same output. Rounds alternate the configurations and report
medians. The limit column is the one-stream bandwidth bound, measured on the spot: every weight
read once per step, one token per step; speculation passes it by yielding several tokens a step.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvserve.arg_types import at_least, folder
from kvserve.engine.spec_state import SpecDecodeStats
from kvserve.engine_args import add_engine_args, llm_from_args
from kvserve.sampling_params import SamplingParams

_PASSAGE = ("The lighthouse stood on the northern cape for more than two hundred years. Its keepers kept a log "
            "of every ship that passed, every storm that broke against the rocks, and every night the lamp "
            "failed. In the winter of 1887 the lamp failed three times, and each time the keeper climbed the "
            "tower with a lantern in his hand and kept the light burning until morning. The log records his "
            "name, the hours he spent on the stairs, and the ships that passed safely while he stood there.")
_TYPOS = {"lighthouse": "lighthose", "northern": "nothern", "storm": "strom", "winter": "wintre",
          "morning": "mornign", "safely": "safley"}


def task_messages() -> dict[str, list[dict[str, str]]]:
    """The three single-stream tasks as chat messages."""
    from kvserve.texts import load_text

    typo = _PASSAGE
    for right, wrong in _TYPOS.items():
        typo = typo.replace(right, wrong, 1)
    document = load_text("python-docs").text[20000:22500]
    return {
        "copying": [{"role": "user", "content": "Rewrite this paragraph with its spelling mistakes corrected, "
                                                "changing nothing else:\n\n" + typo}],
        "summarizing": [{"role": "user", "content": document + "\n\nSummarize the text above in a few sentences."}],
        "chat": [{"role": "user", "content": "Write a short story about a fox who learns to play the violin."}],
    }


def add_spec_parser(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    sp = kinds.add_parser("spec", help="one stream with and without n-gram speculation (copying, summarizing, "
                                       "chat) vs llama.cpp's prompt lookup, and a mixed batch on and off")
    sp.add_argument("--max-tokens", type=at_least(1), default=160, help="most tokens per answer (default 160)")
    sp.add_argument("--rounds", type=at_least(1), default=3, help="rounds, configurations alternating (default 3)")
    sp.add_argument("--skip-llama-cpp", action="store_true", help="leave out llama.cpp")
    sp.add_argument("--out", type=folder, default="bench_out", help="folder for spec.md (default bench_out)")
    add_engine_args(sp)
    sp.set_defaults(speculative="ngram", max_model_len=2048)
    return sp


def _decode_rate(out: Any) -> float:
    """Tokens a second from the first token to the last."""
    span = out.finish_time - out.first_token_time
    return (len(out.token_ids) - 1) / span if span > 0 else float("nan")


def _llama_cpp_rate(lc: Any, prompt: list[int], max_tokens: int, eos: int) -> tuple[float, int]:
    """(tokens a second after the first, tokens) of llama.cpp's greedy answer."""
    lc.reset()
    count, first = 0, 0.0
    for token in lc.generate(prompt, top_k=1, temp=0.0, reset=True):
        count += 1
        if count == 1:
            first = time.perf_counter()
        if token == eos or count >= max_tokens:
            break
    return (count - 1) / (time.perf_counter() - first), count


def run_spec_bench(args: argparse.Namespace, out: Path) -> None:
    from kvserve.engine.chat_template import chat_prompt_ids
    from kvserve.measure.roofline import decode_step_bytes, measure_machine

    on = llm_from_args(args)
    off = llm_from_args(args, speculative=None)
    tokenizer = on.engine.tokenizer
    prompts = {task: chat_prompt_ids(tokenizer, messages) for task, messages in task_messages().items()}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    runners: dict[str, Callable[[list[int]], tuple[float, list[int]]]] = {}
    for name, llm in (("kvserve", off), ("kvserve + ngram", on)):
        def run(prompt: list[int], llm: Any = llm) -> tuple[float, list[int]]:
            result = llm.generate(prompt, params, use_tqdm=False)[0]
            return _decode_rate(result), result.token_ids
        runners[name] = run
    if not args.skip_llama_cpp:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        import torch

        from kvserve.bench.llama_cpp import bf16_gguf
        from kvserve.model.loader import model_path

        path, threads = str(bf16_gguf(Path(model_path(args.model)))), torch.get_num_threads()
        for name, draft in (("llama.cpp", None), ("llama.cpp + prompt lookup", LlamaPromptLookupDecoding(
                max_ngram_size=args.prompt_lookup_max, num_pred_tokens=args.num_speculative_tokens))):
            lc = Llama(model_path=path, n_ctx=args.max_model_len, n_threads=threads, n_threads_batch=threads,
                       draft_model=draft, logits_all=draft is not None, verbose=False)
            runners[name] = lambda prompt, lc=lc: (_llama_cpp_rate(lc, prompt, args.max_tokens,
                                                                   on.engine.eos_token_id)[0], [])
    for prompt in prompts.values():  # warm-up
        for run in runners.values():
            run(prompt[:64])
    rates: dict[tuple[str, str], list[float]] = {}
    outputs: dict[tuple[str, str], list[int]] = {}
    stats = on.engine.update.verifier.stats
    judged = {task: SpecDecodeStats() for task in prompts}  # each task's drafts, over every round
    for r in range(args.rounds):
        print(f"round {r + 1} of {args.rounds}", flush=True)
        for task, prompt in prompts.items():
            for name, run in runners.items():
                before = dataclasses.replace(stats, accepted_lengths=Counter(stats.accepted_lengths))
                rate, tokens = run(prompt)
                rates.setdefault((task, name), []).append(rate)
                outputs[(task, name)] = tokens
                judged[task].drafts += stats.drafts - before.drafts
                judged[task].accepted_tokens += stats.accepted_tokens - before.accepted_tokens
                judged[task].draft_tokens += stats.draft_tokens - before.draft_tokens
    mixed = _mixed_batch(on, off, list(prompts.values()), params, args.rounds)
    machine = measure_machine(on.engine.config.model.torch_dtype)
    lines = _report(args, prompts, rates, outputs, judged, mixed, machine,
                    lambda context: decode_step_bytes(on.engine.model_config, on.engine.config.model.torch_dtype,
                                                      context, on.engine.kv_bytes_per_token))
    (out / "spec.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _mixed_batch(on: Any, off: Any, prompts: list[list[int]], params: SamplingParams,
                 rounds: int) -> dict[str, float]:
    """Output tokens a second of 4 copies of each task at once, speculation off and on taking
    turns for `rounds` rounds: the medians."""
    batch = [p for p in prompts for _ in range(4)]
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(rounds):
        for name, llm in (("off", off), ("on", on)):
            start = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            rates[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in rates.items()}


def _report(args: argparse.Namespace, prompts: dict[str, list[int]], rates: dict[tuple[str, str], list[float]],
            outputs: dict[tuple[str, str], list[int]], judged: dict[str, SpecDecodeStats], mixed: dict[str, float],
            machine: Any,
            step_bytes: Callable[[int], float]) -> list[str]:
    lines = ["# Speculative decoding: one stream, n-gram drafts", "",
             f"`kvserve bench spec --max-tokens {args.max_tokens} --rounds {args.rounds} --num-speculative-tokens "
             f"{args.num_speculative_tokens} --prompt-lookup-min {args.prompt_lookup_min} --prompt-lookup-max "
             f"{args.prompt_lookup_max}`, dtype {args.dtype}; decode tok/s, median of {args.rounds} rounds; memory "
             f"read {machine.read_gb_s:.1f} GB/s measured now", "",
             "| task | prompt tokens | output tokens | kvserve | kvserve + ngram | ratio | same tokens | drafts | "
             "accepted / drafted | acceptance length | one-token bandwidth limit | llama.cpp | llama.cpp + lookup | "
             "ratio |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for task, prompt in prompts.items():
        med = {name: statistics.median(v) for (t, name), v in rates.items() if t == task}
        base, spec = med["kvserve"], med["kvserve + ngram"]
        n = len(outputs[(task, "kvserve")])
        limit = machine.read_gb_s * 1e9 / step_bytes(len(prompt) + n // 2)
        lc, lcs = med.get("llama.cpp"), med.get("llama.cpp + prompt lookup")
        peer = f"{lc:.1f} | {lcs:.1f} | {lcs / lc:.2f}x" if lc and lcs else "- | - | -"
        j = judged[task]
        lines.append(f"| {task} | {len(prompt)} | {n} | {base:.1f} | {spec:.1f} | **{spec / base:.2f}x** | "
                     f"{outputs[(task, 'kvserve')] == outputs[(task, 'kvserve + ngram')]} | {j.drafts} | "
                     f"{j.accepted_tokens} / {j.draft_tokens} | {j.mean_acceptance_length:.2f} | {limit:.0f} | {peer} |")
    lines += ["", f"Mixed batch (4 of each task at once, greedy, median of {args.rounds}): {mixed['off']:.1f} tok/s off, {mixed['on']:.1f} on "
              f"({mixed['on'] / mixed['off']:.2f}x)."]
    return lines
