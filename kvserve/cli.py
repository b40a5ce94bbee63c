"""The `kvserve` command line: generate, chat, serve, bench, memory, eval, tune-kv, doctor."""
from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from typing import Any

from kvserve.arg_types import at_least
from kvserve.engine.chat_template import chat_prompt_ids
from kvserve.engine_args import add_engine_args, flag_names, llm_from_args
from kvserve.sampling_params import SamplingParams
from kvserve.validate import check_utf8


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=at_least(1), default=256,
                   help="tokens to generate (default 256); in chat, at most this many a reply, fewer when "
                        "the conversation leaves less of the context")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _params(args: argparse.Namespace, max_tokens: int | None = None) -> SamplingParams:
    """Raises ValueError naming the option (the sampling options are SamplingParams' fields)."""
    try:
        return SamplingParams(max_tokens=max_tokens or args.max_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop)
    except ValueError as err:
        raise ValueError(re.sub(r"SamplingParams\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"),
                                str(err))) from None


def _stream(llm: Any, prompt: str | list[int], params: SamplingParams) -> str:
    text = ""
    for out in llm.stream(prompt, params):
        print(out.delta_text, end="", flush=True)
        text = out.text
    print()
    return text


def cmd_generate(args: argparse.Namespace) -> None:
    params = _params(args)  # before the model loads
    llm = llm_from_args(args)
    prompt: str | list[int] = args.prompt
    if not args.raw and llm.tokenizer is not None and llm.tokenizer.chat_template:
        check_utf8("prompt", args.prompt)
        prompt = chat_prompt_ids(llm.tokenizer, [{"role": "user", "content": args.prompt}])
    _stream(llm, prompt, params)


def cmd_chat(args: argparse.Namespace) -> None:
    _params(args)  # the options' errors before the model loads
    llm = llm_from_args(args)
    if llm.tokenizer is None or not llm.tokenizer.chat_template:
        sys.exit("kvserve chat: this model has no chat template")
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("kvserve chat: type a message, /reset to start over, Ctrl-D to quit.")
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print()
            return
        if line == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        prompt = chat_prompt_ids(llm.tokenizer, messages)
        # --max-tokens bounds a reply; a long conversation leaves it less room, as the server's
        # chat does, rather than refusing a turn that fits.
        room = llm.engine.max_model_len - len(prompt)
        try:
            reply = _stream(llm, prompt, _params(args, max_tokens=min(args.max_tokens, max(room, 1))))
        except ValueError as err:  # e.g. the conversation outgrew the context
            print(f"error: {err}")
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})


def cmd_bench(args: argparse.Namespace) -> None:
    from kvserve.bench import cli as bench_cli
    bench_cli.run(args)


def _version() -> str:
    try:
        return metadata.version("kvserve")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve", description="An LLM inference engine with a paged KV cache and continuous batching.")
    parser.add_argument("--version", action="version", version=f"kvserve {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a reply to one prompt, streamed to stdout")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--raw", action="store_true",
                     help="complete the text as is instead of applying the chat template")
    add_engine_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat with the chat template applied")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    from kvserve.bench.cli import add_parser as add_bench
    add_bench(sub)
    from kvserve.diagnostics.memory_planner import add_parser as add_memory
    add_memory(sub)
    from kvserve.serve_cli import add_parser as add_serve
    add_serve(sub)
    from kvserve.eval.cli import add_parser as add_eval
    add_eval(sub)
    from kvserve.eval.tune import add_parser as add_tune_kv
    add_tune_kv(sub)
    from kvserve.diagnostics.doctor import add_parser as add_doctor
    add_doctor(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"kvserve {args.command}: error: {flag_names(str(err))}")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
