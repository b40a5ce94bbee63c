"""`kvserve eval`'s rows are named by every layout option that shaped their pages."""
from __future__ import annotations

from kvserve.cli import build_parser
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
