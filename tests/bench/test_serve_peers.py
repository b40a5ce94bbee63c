"""The peers of `kvserve bench serve --peers`: their command lines, how a peer that cannot run is
skipped (and says why), the fields a text-only server is sent, and HF's dtype per machine. No test
here starts a server but the slow one at the end."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

from kvserve.bench.peer_weights import hf_dtype
from kvserve.bench.serve_peers import (
    NO_EOS,
    Skipped,
    llama_server_command,
    resolve_peers,
    text_prompts,
    transformers_serve_command,
)
from kvserve.bench.server_process import ChildServer
from kvserve.bench.workload import WorkloadRequest
from kvserve.cli import build_parser


def serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "serve", *flags])


def test_llama_server_gets_a_slot_per_sequence_each_of_the_model_length() -> None:
    assert llama_server_command(Path("/b/llama-server"), Path("/m/w.bf16.gguf"), 8123, slots=8, max_model_len=2048,
                                threads=2) == [
        "/b/llama-server", "-m", "/m/w.bf16.gguf", "-np", "8", "-c", "16384", "-t", "2", "-tb", "2", "-cb",
        "--host", "127.0.0.1", "--port", "8123"]


def test_transformers_serve_runs_continuous_batching_on_the_dense_directory() -> None:
    assert transformers_serve_command(Path("/hf/smol"), 8124, torch.bfloat16, "cpu", 2048) == [
        sys.executable, "-m", "transformers.cli.transformers", "serve", "/hf/smol", "--continuous-batching",
        "--device", "cpu", "--dtype", "bfloat16", "--max-model-len", "2048", "--host", "127.0.0.1",
        "--port", "8124", "--log-level", "warning"]


def test_a_llama_server_not_built_is_skipped_saying_how_to_build_it(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    [peer] = resolve_peers(serve_args("--peers", "llama-server"))
    assert isinstance(peer, Skipped) and peer.name == "llama-server"
    assert f"no executable at {tmp_path}/llama_cpp/llama-server" in peer.reason
    assert "scripts/build_llama_server.sh" in peer.reason and "--llama-server" in peer.reason
    [named] = resolve_peers(serve_args("--peers", "llama-server", "--llama-server", str(tmp_path / "nowhere")))
    assert isinstance(named, Skipped) and f"no executable at {tmp_path}/nowhere (--llama-server)" in named.reason


def test_random_weights_leave_the_peers_nothing_to_load() -> None:
    peers = resolve_peers(serve_args("--peers", "transformers", "--model", "random:tiny",
                                     "--llama-server", sys.executable))
    assert [(p.name, isinstance(p, Skipped)) for p in peers] == [("transformers", True)]
    assert "--model random:tiny has no weights file" in peers[0].reason  # type: ignore[union-attr]


def test_the_peers_are_named_as_listed_once_each() -> None:
    assert serve_args("--peers", "transformers,llama-server,transformers").peers == ["transformers", "llama-server"]
    assert serve_args().peers == []


def test_a_bad_peer_name_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        serve_args("--peers", "vllm")
    assert "--peers: 'vllm' is not a peer: one of llama-server, transformers" in capsys.readouterr().err


def test_a_text_only_server_gets_the_decoded_prompt_and_eos_off() -> None:
    fields = text_prompts(lambda ids: "|".join(map(str, ids)))
    assert fields(WorkloadRequest([5, 6, 7], 4)) == {"prompt": "5|6|7", "generation_config": NO_EOS}
    assert NO_EOS == '{"eos_token_id": -1}'


def test_a_server_that_exits_at_start_reports_what_it_said() -> None:
    with pytest.raises(RuntimeError, match="fake exited with code 3 before it was ready: no bf16 here"):
        ChildServer(lambda port: [sys.executable, "-c", f"import sys; print('no bf16 here'); sys.exit(3)  # {port}"],
                    "fake", start_timeout=60)


@pytest.mark.parametrize(("flags", "hf_flag", "dtype", "device", "want"), [
    ({"avx512_bf16"}, None, "bfloat16", "cpu", torch.bfloat16),   # native bf16: the engine's dtype
    ({"amx_bf16"}, None, "bf16", "cpu", torch.bfloat16),
    ({"avx2"}, None, "bfloat16", "cpu", torch.float32),           # emulated bf16: float32 is HF's fastest
    ({"avx2"}, None, "bfloat16", "cuda", torch.bfloat16),         # not the CPU's business on a GPU
    ({"avx2"}, "bfloat16", "bfloat16", "cpu", torch.bfloat16),    # --hf-dtype wins
    ({"avx2"}, None, "float16", "cpu", torch.float16),
])
def test_hf_runs_in_the_best_dtype_of_the_machine(flags: set[str], hf_flag: str | None, dtype: str, device: str,
                                                  want: torch.dtype) -> None:
    assert hf_dtype(hf_flag, dtype, device, flags) == want


@pytest.mark.slow
def test_bench_serve_runs_every_peer_in_turn(tmp_path: Path) -> None:
    """Real servers: kvserve, llama-server (where built; else its skip is in the table) and
    transformers serve, two rounds of four requests."""
    from kvserve.cli import main

    main(["bench", "serve", "--num-requests", "4", "--prompt-len-median", "16", "--output-len-median", "8",
          "--max-num-seqs", "2", "--kv-cache-memory", "64MiB", "--max-model-len", "256",
          "--peers", "llama-server,transformers", "--rounds", "2", "--out", str(tmp_path)])
    report = (tmp_path / "serve_load.md").read_text()
    assert report.count("4 completed, 0 failed") >= 4  # kvserve and transformers, both rounds
    assert report.count("engine steps: ") == 2  # kvserve's own step timers, each round
    assert "| kvserve serve / transformers |" in report and "4 of 4 read back by its tokenizer" in report
    assert "| kvserve serve / llama-server |" in report or "| llama-server | skipped: " in report
