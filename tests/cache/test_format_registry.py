"""The format registry: a format defined in this file, registered with one call, runs in the engine,
on the command line, in `kvserve memory` and in `kvserve eval`, and is gone when its block ends;
the built-ins keep the page kinds the kernels number and the defaults each command ran."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cache.formats import (
    FieldSpec,
    Fields,
    PageLayout,
    PerTokenFormat,
    format_names,
    make_format,
    register,
    registered,
)
from kvserve.cli import build_parser
from kvserve.cli import main as cli_main
from kvserve.config import EngineConfig
from kvserve.engine_args import llm_from_args
from kvserve.eval.cli import _rows
from kvserve.eval.quality import forced_logprobs

NAME = "bf16_by_hand"
CLI_ENGINE = ["--model", "random:tiny", "--dtype", "float32", "--kv-cache-memory", "4MiB", "--max-model-len", "256"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8] * 4, [9, 10, 11]]


class RoundedBF16(PerTokenFormat):
    """bf16 pages made by integer arithmetic: each fp32 entry rounded to its top 16 bits (to
    nearest, ties to even), kept as int16 codes. No kernel knows its layout, so the torch backend
    decodes it; it must decode exactly as torch's own cast to bf16, the built-in "bf16"."""
    name = NAME

    @property
    def layout(self) -> PageLayout:
        return PageLayout(None)

    def token_fields(self, num_kv_heads: int, head_dim: int) -> FieldSpec:
        return {"codes": ((num_kv_heads, head_dim), torch.int16)}

    def encode(self, x: torch.Tensor) -> Fields:
        bits = x.float().contiguous().view(torch.int32)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        return {"codes": (rounded >> 16).to(torch.int16)}

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        return (fields["codes"].to(torch.int32) << 16).view(torch.float32).to(dtype)


@pytest.fixture
def bf16_by_hand() -> Iterator[str]:
    with registered(NAME, lambda role, options: RoundedBF16(), default_in=("eval",)):
        yield NAME


def test_the_test_format_rounds_as_torch_does() -> None:
    """Guards the comparisons below: its pages are bf16's, bit for bit, and not the input's."""
    x = torch.randn(300, 2, 16, generator=torch.Generator().manual_seed(0)) * 10
    fmt = RoundedBF16()
    assert torch.equal(fmt.decode(fmt.encode(x), torch.float32), x.to(torch.bfloat16).float())
    assert not torch.equal(fmt.decode(fmt.encode(x), torch.float32), x)


def test_a_format_defined_here_runs_in_the_engine(tiny_llm: Callable[..., LLM], bf16_by_hand: str) -> None:
    ours = tiny_llm(kv_cache_dtype=bf16_by_hand)
    assert ours.engine.attention_backend.name == "torch"  # its layout has no kind: no kernel reads it
    assert all(isinstance(f, RoundedBF16) for f in ours.engine.pool.formats)
    reference = tiny_llm(kv_cache_dtype="bf16", attention_backend="torch")
    dense = tiny_llm(attention_backend="torch")
    assert ours.engine.kv_bytes_per_token == reference.engine.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2

    windows = [[(7 * i + 3 * j) % 128 for j in range(64)] for i in range(2)]
    got = forced_logprobs(ours, windows, prefill_len=24)
    assert torch.equal(got, forced_logprobs(reference, windows, prefill_len=24))
    assert not torch.equal(got, forced_logprobs(dense, windows, prefill_len=24))  # the pages are rounded
    tokens = [o.token_ids for o in ours.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert tokens == [o.token_ids for o in reference.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_the_command_line_builds_an_engine_with_it(bf16_by_hand: str) -> None:
    """`kvserve generate --kv-cache-dtype NAME` as the command reads it (parser, engine options,
    LLM), against the built-in bf16 through the same path."""
    def generate(*flags: str) -> list[list[int]]:
        args = build_parser().parse_args(["generate", "unused", *CLI_ENGINE, *flags])
        return [o.token_ids for o in llm_from_args(args).generate(PROMPTS, GREEDY, use_tqdm=False)]

    ours = generate("--kv-cache-dtype", bf16_by_hand, "--kv-cache-dtype-v", bf16_by_hand)
    assert ours == generate("--kv-cache-dtype", "bf16", "--attention-backend", "torch")


def test_choices_follow_the_registry_and_registration_ends_with_its_block(
        capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()  # built before the format exists: its choices are read at parse time
    flags = ["generate", "unused", "--kv-cache-dtype-k", NAME]
    with registered(NAME, lambda role, options: RoundedBF16()):
        assert parser.parse_args(flags).kv_cache_dtype_k == NAME
        assert NAME in format_names()
    assert NAME not in format_names()
    with pytest.raises(SystemExit):
        parser.parse_args(flags)
    assert f"invalid choice: '{NAME}'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f'unknown format "{NAME}"'):
        make_format(NAME, "k")
    with pytest.raises(ValueError, match=f"kv_cache_dtype must be 'auto'.*got '{NAME}'"):
        EngineConfig.of(kv_cache_dtype=NAME)


def test_kvserve_memory_prices_it_from_its_fields(bf16_by_hand: str, capsys: pytest.CaptureFixture[str]) -> None:
    cli_main(["memory", "--preset", "tiny", "--dtype", bf16_by_hand])
    out = capsys.readouterr().out
    # An int16 code per element: 2 (K and V) x 2 layers x 2 KV heads x 16 head_dim x 2 bytes.
    assert f"KV dtype: {NAME}, 2 bytes per element" in out and "KV per token: 256 bytes" in out


def test_kvserve_eval_runs_it_by_default(bf16_by_hand: str) -> None:
    args = build_parser().parse_args(["eval", *CLI_ENGINE])
    assert args.formats == [*format_names(default_in="eval")] and NAME in args.formats
    rows = dict(_rows(args))  # each row checked as an EngineConfig, before any model loads
    assert rows[NAME]["kv_cache_dtype"] == NAME
    assert build_parser().parse_args(["eval", "--formats", f"{NAME}@16,int8"]).formats == [f"{NAME}@16", "int8"]


def test_names_that_a_list_or_the_engine_could_not_read_are_refused() -> None:
    factory = lambda role, options: RoundedBF16()  # noqa: E731
    for bad in ("auto", "", "a,b", "x@1", "plan:x", "int8"):
        with pytest.raises(ValueError, match="format name"):
            register(bad, factory)
    assert "a,b" not in format_names() and format_names().count("int8") == 1


def test_a_registered_default_window_is_the_engines_default_residual() -> None:
    assert EngineConfig.of(kv_cache_dtype="kivi2").residual_tokens == 128
    assert EngineConfig.of(kv_cache_dtype="int8").residual_tokens == 0
    with registered(NAME, lambda role, options: RoundedBF16(), default_residual=48):
        assert EngineConfig.of(kv_cache_dtype=NAME).residual_tokens == 48
        assert EngineConfig.of(kv_cache_dtype=NAME, kv_residual=0).residual_tokens == 0


# The kernels' page kind numbers (kvserve/kernels: DENSE 0, ABSMAX 1, GROUPED 2, CHANNEL 3,
# HEAD_ABSMAX 4) for each built-in's keys and values; None: the torch backend decodes it.
KERNEL_KINDS = {"bf16": (0, 0), "fp16": (0, 0), "fp32": (0, 0), "fp8_e4m3": (1, 1), "fp8_e5m2": (1, 1),
                "int8": (1, 1), "int4": (2, 2), "kivi2": (3, 2), "kivi4": (3, 2), "outlier": (None, None),
                "sparse": (None, None)}


@pytest.mark.parametrize("name", sorted(KERNEL_KINDS))
def test_builtin_layouts_keep_the_kernels_kind_numbers(name: str) -> None:
    kinds = tuple(make_format(name, role).layout.kind for role in "kv")
    assert kinds == KERNEL_KINDS[name]
    head = make_format(name, "k", fp8_scales="head").layout.kind
    assert head == (4 if name.startswith("fp8") else KERNEL_KINDS[name][0])


def test_builtin_layouts_declare_what_kernels_read() -> None:
    int4 = make_format("int4", "v", group_size=16).layout
    assert (int4.bits, int4.group_size, int4.symmetric, int4.per_token) == (4, 16, False, True)
    values = make_format("kivi2", "v", group_size=8, symmetric_values=True).layout
    assert (values.bits, values.group_size, values.symmetric) == (2, 8, True)
    keys = make_format("kivi4", "k", exact_sink=True, key_wide_channels=16).layout
    assert (keys.bits, keys.per_token, keys.exact_sink, keys.wide, keys.wide_channels) == (4, False, True, 16, None)
    calibrated = make_format("kivi4", "k", key_wide_channels=8).calibrated(torch.rand(2, 64)).layout
    assert calibrated.wide_channels is not None and calibrated.wide_channels.shape == (2, 8)
    assert calibrated == make_format("kivi4", "k", key_wide_channels=8).layout  # tables are values, not layout
    scale = make_format("fp8_e4m3", "v", fp8_scales="head").calibrated(torch.tensor([448.0, 896.0])).layout
    assert scale.head_scale is not None and scale.head_scale.tolist() == [1.0, 2.0]


def test_each_commands_default_formats() -> None:
    """What eval, tune-kv and bench ran before the registry held their lists (order aside)."""
    assert set(format_names(default_in="eval")) == {"fp8_e4m3", "fp8_e5m2", "int8", "int4", "kivi4", "kivi2",
                                                     "outlier", "sparse"}
    assert set(format_names(default_in="tune")) == {"int8", "fp8_e4m3", "kivi4", "int4", "kivi2"}
    args = build_parser().parse_args(["bench", "kv-formats"])
    assert args.formats == "auto,int8,int4,kivi2@32"
    assert build_parser().parse_args(["bench", "attention"]).formats == "auto,int8,int4"
    assert build_parser().parse_args(["tune-kv", "--max-kl", "0.1"]).candidates.split(",") == \
        list(format_names(default_in="tune"))
