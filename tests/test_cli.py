"""The command line as a user runs it."""
from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.cli import build_parser


def kvserve(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvserve", *args], capture_output=True, text=True,
                          input=stdin, timeout=300)


def test_help_explains_commands() -> None:
    out = kvserve("--help")
    assert out.returncode == 0
    for command in ("generate", "chat", "bench"):
        assert command in out.stdout
    gen = kvserve("generate", "--help")
    assert "--kv-cache-memory" in gen.stdout and "--temperature" in gen.stdout


def subcommand(name: str) -> argparse.ArgumentParser:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def test_help_shows_each_commands_own_defaults_and_on_off_ones() -> None:
    doctor = " ".join(subcommand("doctor").format_help().split())
    assert "fraction of free memory like 0.5 (default: 256MiB)" in doctor  # doctor's, not the engine's 2GiB
    generate = " ".join(subcommand("generate").format_help().split())
    assert "fraction of free memory like 0.5 (default: 2GiB)" in generate
    assert "reuse the K/V of shared prompt prefixes (paged mode) (default: True)" in generate
    assert "(default: False)" in generate  # e.g. --kv-exact-sink


def test_version() -> None:
    out = kvserve("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"kvserve {metadata.version('kvserve')}"


def test_an_engine_option_error_names_the_flag() -> None:
    out = kvserve("generate", "Hi", "--kv-cache-dtype", "int3")
    assert out.returncode != 0 and "--kv-cache-dtype must be 'auto', 'plan:PATH'" in out.stderr
    assert "EngineConfig" not in out.stderr and "int3" in out.stderr


def options(parser: argparse.ArgumentParser, command: str = "kvserve") -> Iterator[tuple[str, argparse.Action]]:
    """(command, action) for every option and positional of `parser` and of its subcommands, recursively."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from options(sub, f"{command} {name}")
        else:
            yield command, action


def test_every_option_of_every_command_has_help() -> None:
    missing = [f"{command} {'/'.join(action.option_strings) or action.dest}"
               for command, action in options(build_parser()) if not action.help]
    assert not missing, f"options without help: {missing}"


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The stderr of parsing `argv`, which must end as a usage error (exit 2) before any work."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


WHOLE = "must be a whole number"


# Each used to be taken, and failed late (in the engine, in a division, after loading the model)
# or not at all.
@pytest.mark.parametrize("argv, expected", [
    (["generate", "--max-tokens", "0", "hi"], f"--max-tokens: {WHOLE}"),
    (["bench", "throughput", "--num-requests", "0"], f"--num-requests: {WHOLE}"),
    (["bench", "replicas", "--replicas", "0"], f"--replicas: {WHOLE}"),
    (["bench", "scaling", "--num-tokens", "-1"], f"--num-tokens: {WHOLE}"),
    (["doctor", "--tokens", "0"], f"--tokens: {WHOLE}"), (["tune-kv", "--window-len", "1"], f"--window-len: {WHOLE}"),
    (["memory", "--preset", "tiny", "--batch", "x"], f"--batch: {WHOLE}"),
    (["serve", "--port", "70000"], f"--port: {WHOLE}"),  # it used to listen on 70000 mod 65536
    (["serve", "--replicas", "0"], f"--replicas: {WHOLE}"),
    (["serve", "--max-request-bytes", "10"], f"--max-request-bytes: {WHOLE}"),
    (["serve", "--shutdown-timeout", "nan"], "--shutdown-timeout: must be a number >= 0"),
    (["serve", "--router-stats-period", "-1"], "--router-stats-period: must be a number > 0"),
    (["serve", "--served-model-name", ""], "--served-model-name: must not be empty"),
])
def test_bad_option_values_are_usage_errors_naming_the_option(argv: list[str], expected: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert f"argument {expected}" in usage_error(argv, capsys)


@pytest.mark.parametrize("command", [["doctor"], ["eval"], ["bench", "throughput"], ["bench", "scaling"]])
def test_an_out_folder_that_is_a_file_is_refused_before_any_work(command: list[str], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # doctor used to run every check, then die with a FileExistsError traceback.
    taken = tmp_path / "results"
    taken.write_text("")
    assert "argument --out: " in usage_error([*command, "--out", str(taken)], capsys)


def test_invalid_sampling_parameter_is_a_clear_error() -> None:
    # Named as the user typed it, and before any model loads (a file that is not there).
    out = kvserve("generate", "hi", "--model", "/no/such/model.gguf", "--top-p", "1.5")
    assert out.returncode != 0 and "error: --top-p must be in (0, 1]" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_unknown_model_file_is_a_clear_error() -> None:
    out = kvserve("generate", "hi", "--model", "/no/such/model.gguf")
    assert out.returncode != 0 and "no such file" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.model
def test_generate_answers_with_the_bundled_model() -> None:
    """In fp32: the model's first token is a near-tie ("The" -1.88 nats, "L" -1.97), which bf16
    rounding settles either way depending on the CPU's GEMM kernels (AMX oneDNN picks "L'Étoile")."""
    out = kvserve("generate", "What is the capital of France?", "--max-tokens", "24", "--dtype", "float32")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    default = kvserve("generate", "What is the capital of France?", "--max-tokens", "8")
    assert default.returncode == 0 and default.stdout.strip(), default.stderr


@pytest.mark.model
def test_chat_streams_replies_until_eof() -> None:
    out = kvserve("chat", "--max-tokens", "16", stdin="Hello!\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("> ") == 2 and len(out.stdout.splitlines()) >= 3


@pytest.mark.model
def test_chat_takes_a_turn_that_fits_with_less_room_than_max_tokens() -> None:
    # ~280 prompt tokens + the default --max-tokens 256 pass max_model_len 512: the turn was refused.
    message = " ".join(["word"] * 250)
    out = kvserve("chat", "--max-model-len", "512", "--kv-cache-memory", "64MiB", stdin=message + "\n")
    assert out.returncode == 0 and "error:" not in out.stdout, out.stdout
    assert len(out.stdout.splitlines()) >= 3


def test_a_baseline_beside_a_paged_run_drops_what_only_paged_blocks_do() -> None:
    from kvserve.config import EngineConfig
    from kvserve.engine_args import engine_kwargs

    args = build_parser().parse_args(["bench", "throughput", "--preemption-mode", "swap", "--offload-memory", "1MiB"])
    assert engine_kwargs(args)["preemption_mode"] == "swap"
    for mode in ("contiguous", "no-cache"):
        kwargs = engine_kwargs(args, mode)
        assert (kwargs["cache_mode"], kwargs["preemption_mode"], kwargs["offload_memory"]) == (mode, "recompute", "0")
        EngineConfig.of(**kwargs)  # valid, where the paged options would be refused


def test_engine_options_are_grouped_by_part() -> None:
    """`--help` shows the engine's options in one group per part of the configuration."""
    text = subcommand("generate").format_help()
    order = [text.index(f"engine: {part} ({cls}Options)") for part, cls in
             (("model", "Model"), ("cache", "Cache"), ("KV format", "KVFormat"), ("eviction", "Eviction"),
              ("scheduler", "Scheduler"), ("parallel", "Parallel"), ("runtime", "Runtime"))]
    assert order == sorted(order)
    eviction = text[order[3]:order[4]]
    assert "--kv-budget" in eviction and "--kv-cache-dtype" not in eviction
