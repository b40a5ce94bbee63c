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
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvserve.arg_types import at_least, folder
from kvserve.config import DTYPES
from kvserve.engine.spec_state import SpecDecodeStats
from kvserve.engine_args import add_engine_args
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


class _EngineProcess:
    """One kvserve configuration in a process of its own, so that both sides of a ratio are the
    only engine of their process (a second engine in one process ran up to 10% apart from the
    first, either way, on this machine)."""

    def __init__(self, options: dict[str, Any]) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, options), daemon=True)
        self.process.start()
        self.eos_token_id, self.prompts, self.model_config, self.kv_bytes_per_token = self.conn.recv()

    def ask(self, kind: str, prompts: list[list[int]], params: SamplingParams
            ) -> tuple[float, list[int], tuple[int, int, int]]:
        """("one": decode tok/s of the first | "batch": output tok/s of all), the first's tokens,
        and the (drafts, draft tokens, accepted tokens) they ran."""
        self.conn.send((kind, prompts, params))
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.process.join(timeout=30)


def _serve(conn: Any, options: dict[str, Any]) -> None:
    """The engine process: builds the engine and the task prompts, then times what it is asked."""
    from kvserve import LLM
    from kvserve.engine.chat_template import chat_prompt_ids

    llm = LLM(**options)
    engine = llm.engine
    conn.send((engine.eos_token_id, {task: chat_prompt_ids(engine.tokenizer, messages)
                                     for task, messages in task_messages().items()},
               engine.model_config, engine.kv_bytes_per_token))
    while (message := conn.recv()) is not None:
        kind, prompts, params = message
        stats = engine.update.verifier.stats
        before = (stats.drafts, stats.draft_tokens, stats.accepted_tokens)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        judged = (stats.drafts - before[0], stats.draft_tokens - before[1], stats.accepted_tokens - before[2])
        rate = _decode_rate(outs[0]) if kind == "one" else sum(len(o.token_ids) for o in outs) / wall
        conn.send((rate, outs[0].token_ids, judged))


def run_spec_bench(args: argparse.Namespace, out: Path) -> None:
    from kvserve.engine_args import engine_kwargs
    from kvserve.measure.roofline import decode_step_bytes, measure_machine

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    engines = {"kvserve": _EngineProcess(engine_kwargs(args, speculative=None)),
               "kvserve + ngram": _EngineProcess(engine_kwargs(args))}
    base = engines["kvserve"]
    prompts = base.prompts
    runners: dict[str, Callable[[list[int]], tuple[float, list[int], tuple[int, int, int]]]] = {
        name: (lambda prompt, e=engine: e.ask("one", [prompt], params)) for name, engine in engines.items()}
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
            runners[name] = lambda prompt, lc=lc: (
                _llama_cpp_rate(lc, prompt, args.max_tokens, base.eos_token_id)[0], [], (0, 0, 0))
    for prompt in prompts.values():  # warm-up
        for run in runners.values():
            run(prompt[:64])
    rates: dict[tuple[str, str], list[float]] = {}
    outputs: dict[tuple[str, str], list[int]] = {}
    judged = {task: SpecDecodeStats() for task in prompts}  # each task's drafts, over every round
    mixed: dict[str, list[float]] = {name: [] for name in engines}
    batch = [p for p in prompts.values() for _ in range(8)]
    for r in range(args.rounds):
        print(f"round {r + 1} of {args.rounds}", flush=True)
        for task, prompt in prompts.items():
            for name, run in runners.items():
                rate, tokens, (drafts, drafted, accepted) = run(prompt)
                rates.setdefault((task, name), []).append(rate)
                outputs[(task, name)] = tokens
                judged[task].drafts += drafts
                judged[task].draft_tokens += drafted
                judged[task].accepted_tokens += accepted
        for name, engine in engines.items():
            mixed[name].append(engine.ask("batch", batch, params)[0])
    for engine in engines.values():
        engine.close()
    dtype = DTYPES[args.dtype]
    lines = _report(args, prompts, rates, outputs, judged,
                    {"off": statistics.median(mixed["kvserve"]), "on": statistics.median(mixed["kvserve + ngram"])},
                    measure_machine(dtype),
                    lambda context: decode_step_bytes(base.model_config, dtype, context, base.kv_bytes_per_token))
    (out / "spec.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


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
    lines += ["", f"Mixed batch (8 of each task at once, greedy, median of {args.rounds}): {mixed['off']:.1f} tok/s "
                  f"off, {mixed['on']:.1f} on ({mixed['on'] / mixed['off']:.2f}x)."]
    return lines
