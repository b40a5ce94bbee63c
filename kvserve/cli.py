"""The `kvserve` command line: generate, chat, serve, bench, memory, eval."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from kvserve.attention.selector import BACKEND_NAMES
from kvserve.cache.kv_format import FORMAT_NAMES
from kvserve.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="a .gguf file, a Hugging Face model directory, or random:<preset> "
                        "(default: the bundled SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16 or float32")
    g.add_argument("--device", default="auto", help="auto (default: cuda if present), cpu or cuda")
    g.add_argument("--kv-cache-memory", default="2GiB",
                   help="KV pool size: bytes like 2GiB, or a fraction of free memory like 0.5")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    g.add_argument("--max-num-seqs", type=int, default=32, help="sequences per batch (default 32)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--cache-mode", default="paged", choices=["paged", "contiguous", "no-cache"],
                   help="paged (default); contiguous and no-cache are baselines")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default 512 with chunked prefill, else max(max-model-len, 2048))")
    g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                   help="prefill whole prompts in steps of their own (default: chunks beside running decodes)")
    k = p.add_argument_group("kernels")
    k.add_argument("--attention-backend", default="auto", choices=BACKEND_NAMES,
                   help="auto (default): the fastest that serves the configuration (cpu: C++ kernel reading "
                        "pages in place); torch: the gather + SDPA reference")
    k.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                   help="eager torch ops instead of the compiled fused CPU ops and bf16 small-batch linear")
    q = p.add_argument_group("KV cache format")
    q.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *FORMAT_NAMES],
                   help="how K/V pages are stored: auto (default) keeps the model dtype; fp8_e4m3, fp8_e5m2, "
                        "int8, int4, kivi2, kivi4, outlier and sparse compress them")
    q.add_argument("--kv-cache-dtype-k", default=None, choices=FORMAT_NAMES, help="keys only (default: as above)")
    q.add_argument("--kv-cache-dtype-v", default=None, choices=FORMAT_NAMES, help="values only (default: as above)")
    q.add_argument("--kv-group-size", type=int, default=32,
                   help="channels per scale for int4, kivi values and outlier (4..128, default 32)")
    q.add_argument("--kv-residual", type=int, default=None,
                   help="recent tokens kept in full precision (default: 128 with kivi, else 0)")
    q.add_argument("--kv-outliers", type=int, default=4, help="exact entries per token-head for 'outlier' (default 4)")
    q.add_argument("--kv-sparse-threshold", type=float, default=0.5,
                   help="'sparse' drops entries below this times the token-head RMS (default 0.5)")
    q.add_argument("--kv-sparse-capacity", type=float, default=0.5,
                   help="'sparse' stores at most this fraction of head_dim per token-head (default 0.5)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens to generate (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def llm_from_args(args: argparse.Namespace, cache_mode: str | None = None, **overrides: Any) -> Any:
    from kvserve import LLM
    kwargs = dict(model=args.model, dtype=args.dtype, device=args.device,
                  kv_cache_memory=_memory(str(args.kv_cache_memory)), block_size=args.block_size,
                  max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                  cache_mode=cache_mode or args.cache_mode, kv_cache_dtype=args.kv_cache_dtype,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  enable_chunked_prefill=args.enable_chunked_prefill, attention_backend=args.attention_backend,
                  cpu_kernels=args.cpu_kernels,
                  kv_cache_dtype_k=args.kv_cache_dtype_k, kv_cache_dtype_v=args.kv_cache_dtype_v,
                  kv_group_size=args.kv_group_size, kv_residual=args.kv_residual, kv_outliers=args.kv_outliers,
                  kv_sparse_threshold=args.kv_sparse_threshold, kv_sparse_capacity=args.kv_sparse_capacity)
    return LLM(**{**kwargs, **overrides})


def kv_format_overrides(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    """A format as benchmark and eval lists write it: `name`, or `name@residual` for its own
    full-precision window."""
    name, _, residual = spec.partition("@")
    return {"kv_cache_dtype": name, "kv_residual": int(residual) if residual else args.kv_residual}


def _memory(text: str) -> str | float:
    try:
        return float(text)
    except ValueError:
        return text


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, stop=args.stop)


def _stream(llm: Any, prompt: str | list[int], params: SamplingParams) -> str:
    text = ""
    for out in llm.stream(prompt, params):
        print(out.delta_text, end="", flush=True)
        text = out.text
    print()
    return text


def cmd_generate(args: argparse.Namespace) -> None:
    llm = llm_from_args(args)
    prompt: str | list[int] = args.prompt
    if not args.raw and llm.tokenizer is not None and llm.tokenizer.chat_template:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                   add_generation_prompt=True, tokenize=False)
    _stream(llm, prompt, _params(args))


def cmd_chat(args: argparse.Namespace) -> None:
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
        prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        try:
            reply = _stream(llm, prompt, _params(args))
        except ValueError as err:  # e.g. the conversation outgrew the context
            print(f"error: {err}")
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})


def cmd_bench(args: argparse.Namespace) -> None:
    from kvserve.bench import cli as bench_cli
    bench_cli.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve", description="An LLM inference engine with a paged KV cache and continuous batching.")
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
    from kvserve.server.cli import add_parser as add_serve
    add_serve(sub)
    from kvserve.eval.cli import add_parser as add_eval
    add_eval(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"kvserve {args.command}: error: {err}")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
