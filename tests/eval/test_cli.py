"""`kvserve eval`'s rows are named by every layout option that shaped their pages; its options are
checked, alone and together, before any model loads."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.cli import build_parser, main
from kvserve.cache.formats import format_names
from kvserve.eval.cli import _format_label


def label(name: str, rotation: str, *flags: str) -> str:
    return _format_label(name, rotation, build_parser().parse_args(["eval", *flags]))


def test_rows_name_sinks_wide_channels_symmetric_values_and_what_is_rotated() -> None:
    assert label("int8", "none") == "int8"
    assert label("int8", "hadamard", "--kv-exact-sink") == "int8 rotated (hadamard)"  # sinks are KIVI's alone
    flags = ("--kv-exact-sink", "--kv-key-wide-channels", "24", "--kv-symmetric-values", "--no-kv-rotate-keys")
    assert (label("kivi2@0", "hadamard", *flags)
            == "kivi2@0 exact sink 24 wide key channels symmetric values values rotated (hadamard)")
    assert label("kivi4", "random", "--kv-exact-sink") == "kivi4 exact sink rotated (random)"


def run_eval(tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[object, str]:
    """`kvserve eval` on a model that cannot load: an option's error can only come first if the
    options are checked before any model loads. (exit code, stderr)."""
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--model", str(tmp_path / "no-such-model.gguf"), "--out", str(tmp_path), *flags])
    return exit_.value.code, capsys.readouterr().err


@pytest.mark.parametrize(("flags", "option"), [
    (["--passkey-trials", "0"], "--passkey-trials"),  # was a ZeroDivisionError after the reference run
    (["--passkey-lengths", "256,0"], "--passkey-lengths"),
    (["--passkey-lengths", "256,many"], "--passkey-lengths"),
    (["--formats", "int8,int3"], "--formats"),
    (["--formats", "kivi2@recent"], "--formats"),
    (["--rotations", "hadamard,spin"], "--rotations"),
    (["--evictions", "h2o,lru"], "--evictions"),
    (["--evictions", "none"], "--evictions"),  # "evict none" would repeat the format's row
    (["--stride", "0"], "--stride"),
    (["--window-len", "1"], "--window-len"),  # nothing to prefill and decode
    (["--windows", "0"], "--windows"),
    (["--first-window", "-1"], "--first-window"),
    (["--greedy-prompts", "-1"], "--greedy-prompts"),
    (["--greedy-tokens", "0"], "--greedy-tokens"),
    (["--hf-bits", "4,two"], "--hf-bits"),
    (["--hf-backend", "bitsandbytes"], "--hf-backend"),
    (["--kvpress", "/no/such/python"], "--kvpress"),
])
def test_a_bad_option_is_a_usage_error_before_any_model_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               flags: list[str], option: str) -> None:
    code, err = run_eval(tmp_path, capsys, *flags)
    assert code == 2 and f"argument {option}:" in err, (code, err)


@pytest.mark.parametrize(("flags", "option"), [
    (["--evictions", "h2o"], "--evictions h2o"),  # no --kv-budget
    (["--evictions", "h2o", "--kv-budget", "64", "--kv-cache-dtype", "kivi2"], "--evictions h2o"),
    (["--formats", "int8,kivi2", "--kv-eviction", "window", "--kv-budget", "64"], "--formats kivi2"),
    (["--window-len", "4096"], "--window-len"),  # beyond --max-model-len 2048
    (["--greedy-tokens", "2000"], "--greedy-tokens"),
    (["--passkey-lengths", "256,4096"], "--passkey-lengths"),
    (["--hf-bits", "3"], "--hf-bits"),  # quanto quantizes to 2 or 4 bits
    (["--data", "/no/such/text.txt"], "--data"),
    (["--data", "python-docs,python-docs"], "--data: a text is named twice"),
    (["--data", "python-docs,calibration", "--kv-fp8-scales", "head"], "--data: calibration text"),
])
def test_options_that_do_not_go_together_are_a_usage_error_before_any_model_loads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], option: str) -> None:
    code, err = run_eval(tmp_path, capsys, *flags)
    assert code == 2 and f"kvserve eval: error: {option}" in err, (code, err)


def test_list_options_are_read_into_lists_with_their_defaults() -> None:
    args = build_parser().parse_args(["eval", "--formats", "int8,kivi2@32,", "--hf-bits", ""])
    assert args.formats == ["int8", "kivi2@32"] and args.hf_bits == []
    defaults = build_parser().parse_args(["eval"])
    assert defaults.formats == list(format_names(default_in="eval")) and defaults.passkey_lengths == [256, 512, 1024]
    assert defaults.evictions == [] and defaults.rotations is None and defaults.hf_bits == [4, 2]


def test_a_model_without_a_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    """random:<preset> weights have no tokenizer (this was an AttributeError traceback)."""
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--model", "random:tiny", "--max-model-len", "512", "--passkey-lengths", "64",
              "--hf-bits", "", "--out", str(tmp_path)])
    assert "--model: this model has no tokenizer" in str(exit_.value.code)


def test_a_text_that_shares_a_passage_with_the_calibration_text_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Only where a row is calibrated (wide key channels, per-head fp8 scales): a file quoting 200
    characters of the calibration text is refused, naming both options; calibrating on that file
    on another text makes the bundled one a fair evaluation text."""
    from kvserve.texts import load_text

    quoted = tmp_path / "notes.txt"
    quoted.write_text("My notes.\n" + load_text("calibration").text[5000:5200] + "\nThe end.\n", encoding="utf-8")
    code, err = run_eval(tmp_path, capsys, "--data", f"python-docs,{quoted}", "--formats", "kivi2",
                         "--kv-key-wide-channels", "8")
    assert code == 2 and "--data: notes.txt shares text with the calibration text" in err
    assert "--kv-calibration-data" in err
    code, err = run_eval(tmp_path, capsys, "--data", f"python-docs,{quoted}", "--formats", "kivi2")
    assert "shares text" not in err  # not calibrated: the run goes on (to the missing model)
    # Per-head fp8 scales asked for, but no row has fp8 pages: nothing is calibrated.
    code, err = run_eval(tmp_path, capsys, "--data", f"python-docs,{quoted}", "--formats", "int8",
                         "--kv-fp8-scales", "head")
    assert "shares text" not in err
    code, err = run_eval(tmp_path, capsys, "--data", "calibration", "--formats", "kivi2",
                         "--kv-key-wide-channels", "8", "--kv-calibration-data", "python-docs")
    assert "shares text" not in err
