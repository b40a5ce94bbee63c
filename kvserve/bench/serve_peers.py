"""The peers of `kvserve bench serve --peers`: llama.cpp's `llama-server` and HF's `transformers
serve`, each started by the benchmark on kvserve's weights, sent the same workload by the same
client (bench/serving.py), and stopped before the next server starts (two servers side by side
would share the cores).

- `llama-server`: the binary scripts/build_llama_server.sh builds (or `--llama-server`), on the bf16
  GGUF of the same weights (bench/llama_cpp.py), `--max-num-seqs` parallel slots of
  `--max-model-len` tokens each, continuous batching, its prompt cache on (its default), as many
  threads as kvserve's torch;
- `transformers`: `transformers serve` with continuous batching on the dense HF directory HF's
  other benchmarks load (`hf_bench_dir`), in the dtype `peer_weights.hf_dtype` picks, with
  libgomp's default spin (bench/hf_process.py says why). It takes a prompt as text only
  (`prompt must be a string`) and refuses `ignore_eos` (422, an unexpected field), so it gets the
  ids decoded by its own tokenizer and EOS off through its `generation_config` field (eos_token_id
  -1, which its continuous batching takes per request); the report says how many prompts its
  tokenizer reads back to exactly the ids the other servers get. Its stream joins the tokens
  ready together into one chunk (ITL counts one gap for them, as vLLM's client would); its usage
  chunk gives the token count. Its continuous batching has no limit on sequences at once to set
  (`--cb-*` size blocks and tokens only).

A peer that cannot run is a `Skipped`, with the reason and how to make it run.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvserve.bench.hf_process import OPENMP_DEFAULT_SPINCOUNT
from kvserve.bench.peer_weights import hf_dtype, peer_source
from kvserve.bench.serving import PromptFields, token_id_prompt
from kvserve.bench.workload import WorkloadRequest
from kvserve.paths import cache_root

PEERS = ("llama-server", "transformers")
# First starts measured here (2 shared cores): llama-server ~2 s, transformers serve ~50 s (imports).
START_TIMEOUT_S = 600.0
NO_EOS = json.dumps({"eos_token_id": -1})


@dataclass(frozen=True)
class Peer:
    """A peer ready to start: `command(port)` its command line, `prompt_fields` how it is asked,
    `describe(requests)` how it ran, for the report."""
    name: str
    command: Callable[[int], list[str]]
    prompt_fields: PromptFields = token_id_prompt
    describe: Callable[[list[WorkloadRequest]], str] = lambda requests: ""
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Skipped:
    name: str
    reason: str


def default_llama_server() -> Path:
    return cache_root() / "llama_cpp" / "llama-server"


def llama_server_command(binary: Path, gguf: Path, port: int, slots: int, max_model_len: int,
                         threads: int) -> list[str]:
    """llama-server as the issue's peer: `slots` parallel slots of `max_model_len` tokens each
    (its `-c` is the whole context, shared by the slots), continuous batching, prompt cache on."""
    return [str(binary), "-m", str(gguf), "-np", str(slots), "-c", str(slots * max_model_len), "-t", str(threads),
            "-tb", str(threads), "-cb", "--host", "127.0.0.1", "--port", str(port)]


def transformers_serve_command(hf_dir: Path, port: int, dtype: torch.dtype, device: str,
                               max_model_len: int) -> list[str]:
    """`transformers serve` with continuous batching, the model loaded at start (FORCE_MODEL), run
    by this interpreter (the transformers it imports, not whichever a `transformers` on PATH is)."""
    return [sys.executable, "-m", "transformers.cli.transformers", "serve", str(hf_dir), "--continuous-batching",
            "--device", device, "--dtype", str(dtype).removeprefix("torch."), "--max-model-len", str(max_model_len),
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]


def text_prompts(decode: Callable[[list[int]], str]) -> PromptFields:
    """Fields for a server that takes text prompts and no `ignore_eos` (transformers serve)."""
    return lambda request: {"prompt": decode(request.prompt_token_ids), "generation_config": NO_EOS}


def add_peer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("peers")
    g.add_argument("--peers", type=_peer_list, default=[],
                   help=f"other servers to start and measure after kvserve on the same workload, comma-separated: "
                        f"{', '.join(PEERS)} (default: none). llama-server runs the bf16 GGUF of the same weights "
                        f"with --max-num-seqs slots; transformers serve the same dense weights with continuous "
                        f"batching, in --hf-dtype. A peer that cannot run is skipped, saying why")
    g.add_argument("--llama-server", type=Path, default=None, metavar="PATH",
                   help=f"the llama-server binary (default: {default_llama_server()}, which "
                        f"scripts/build_llama_server.sh builds)")


def _peer_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name not in PEERS:
            raise argparse.ArgumentTypeError(f"{name!r} is not a peer: one of {', '.join(PEERS)}")
    return list(dict.fromkeys(names))


def resolve_peers(args: argparse.Namespace) -> list[Peer | Skipped]:
    """The `--peers` asked, each ready to start or skipped with its reason."""
    source = peer_source(args.model)
    makers = {"llama-server": _llama_server, "transformers": _transformers}
    return [makers[name](args, source) for name in args.peers]


def _llama_server(args: argparse.Namespace, source: str) -> Peer | Skipped:
    name = "llama-server"
    binary = args.llama_server or default_llama_server()
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        how = ("build it once with scripts/build_llama_server.sh (or scripts/install.sh --bench; 6-10 minutes on "
               "2 cores)" if args.llama_server is None else "name a llama-server binary")
        return Skipped(name, f"llama-server is not built: no executable at {binary} (--llama-server); {how}")
    if not source.endswith(".gguf"):
        return Skipped(name, f"llama-server runs a GGUF, and --model {args.model} is not one")
    if importlib.util.find_spec("llama_cpp") is None:
        return Skipped(name, "the bf16 GGUF of the weights is made by llama-cpp-python, not installed: "
                             "pip install 'kvserve[bench]'")
    from kvserve.bench.llama_cpp import bf16_gguf

    gguf, threads = bf16_gguf(Path(source)), torch.get_num_threads()

    def command(port: int) -> list[str]:
        return llama_server_command(binary, gguf, port, args.max_num_seqs, args.max_model_len, threads)
    return Peer(name, command, describe=lambda requests: _shown(command))


def _transformers(args: argparse.Namespace, source: str) -> Peer | Skipped:
    name = "transformers"
    missing = [m for m in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(m) is None]
    if missing:
        return Skipped(name, f"transformers serve needs {', '.join(missing)}: pip install 'transformers[serving]'")
    if not source:
        return Skipped(name, f"--model {args.model} has no weights file for HF to load")
    from transformers import AutoTokenizer

    from kvserve.bench.hf_baseline import hf_bench_dir

    hf_dir, dtype = hf_bench_dir(source), hf_dtype(args.hf_dtype, args.dtype, args.device)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def command(port: int) -> list[str]:
        return transformers_serve_command(hf_dir, port, dtype, args.device, args.max_model_len)

    threads = str(torch.get_num_threads())

    def describe(requests: list[WorkloadRequest]) -> str:
        # What it computes is what its tokenizer reads from the text, as its server encodes a prompt.
        same = sum(tokenizer(decode(r.prompt_token_ids))["input_ids"] == r.prompt_token_ids for r in requests)
        return (f"{_shown(command)}, OMP_NUM_THREADS={threads}; no limit on sequences at once (none to set); "
                f"prompts sent as text: {same} of {len(requests)} read back by its tokenizer to exactly the ids the "
                f"other servers get")

    return Peer(name, command, text_prompts(decode), describe,
                env={"GOMP_SPINCOUNT": OPENMP_DEFAULT_SPINCOUNT, "OMP_NUM_THREADS": threads})


def _shown(command: Callable[[int], list[str]]) -> str:
    """A peer's command line as the report prints it."""
    return "`" + " ".join(command(0)).replace("--port 0", "--port PORT") + "`"
