"""Texts found without a download; and the commands that read them run from a bare copy of the
package (no ../shared, no optimum-quanto), as a `pip install`ed kvserve would."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvserve
import random

from kvserve.texts import load_text, shared_passage, wikitext_path


def test_python_docs_is_english_prose_inside_cpython() -> None:
    text = load_text("python-docs")
    assert text.name.startswith("Python reference docs") and len(text.text) > 200_000
    assert "The \"assert\" statement" in text.text
    assert load_text("python-docs", max_chars=100).text == text.text[:100]


def test_wikitext_comes_from_the_environment_and_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "wiki.test.raw"
    path.write_text(" = Valkyria Chronicles III = \n", encoding="utf-8")
    monkeypatch.setenv("KVSERVE_WIKITEXT", str(path))
    assert wikitext_path() == path
    assert load_text(None) == load_text("wikitext2")
    assert load_text(None).name == "WikiText-2 (test)" and "Valkyria" in load_text(None).text
    monkeypatch.setenv("KVSERVE_WIKITEXT", str(tmp_path / "absent"))
    assert load_text(None).name.startswith("Python reference docs")  # the default falls back, named
    with pytest.raises(ValueError, match="--data: WikiText-2 is not redistributed"):
        load_text("wikitext2")


def test_a_path_names_itself_and_a_bad_one_names_the_option(tmp_path: Path) -> None:
    path = tmp_path / "my.txt"
    path.write_text("hello", encoding="utf-8")
    assert load_text(str(path)).name == "my.txt"
    with pytest.raises(ValueError, match="--data: .*not a file"):
        load_text(str(tmp_path / "nope.txt"))


def test_a_binary_or_empty_file_is_refused_naming_the_option(tmp_path: Path) -> None:
    binary, empty = tmp_path / "blob.bin", tmp_path / "empty.txt"
    binary.write_bytes(bytes(range(256)) * 4)
    empty.write_text("\n \n")
    with pytest.raises(ValueError, match=r"--data: .*blob.bin is not UTF-8 text \(byte 128"):
        load_text(str(binary))
    with pytest.raises(ValueError, match=r"--data: .*empty.txt is empty"):
        load_text(str(empty))


def test_the_calibration_text_ships_with_the_package_and_no_evaluation_text_shares_it() -> None:
    text = load_text("calibration")
    assert (Path(kvserve.__file__).parent / "calibration.txt").is_file()
    assert "Heap queues" in text.text and "def bisect_right" in text.text and len(text.text) > 40_000
    evaluated = [load_text("python-docs")] + ([load_text("wikitext2")] if wikitext_path() else [])
    assert all(shared_passage(t.text, text.text) is None for t in evaluated)


@pytest.mark.parametrize("seed", range(4))
def test_a_shared_passage_of_96_characters_is_found_wherever_it_lies(seed: int) -> None:
    """Two random texts share nothing (a chance 64-character match is ~impossible); a 96-character
    passage of one put anywhere in the other is found, a 60-character one is not looked for."""
    rng = random.Random(seed)
    a, b = ("".join(rng.choice("abcdefgh ") for _ in range(n)) for n in (20_000, 5_000))
    assert shared_passage(a, b) is None
    for length, found in ((96, True), (60, False)):
        start, at = rng.randrange(len(b) - length), rng.randrange(len(a))
        passage = b[start:start + length]
        planted = a[:at] + passage + a[at:]
        got = shared_passage(planted, b)
        assert (got is not None) == found and (got is None or got in passage)
        assert (shared_passage(b, planted) is not None) == found  # either order


@pytest.mark.model
def test_eval_bench_and_doctor_run_from_a_bare_copy_of_the_package(tmp_path: Path) -> None:
    """A copy of kvserve/ alone on the path, run from an empty folder; a stand-in `optimum`
    package without quanto hides the real one."""
    site = tmp_path / "site"
    shutil.copytree(Path(kvserve.__file__).parent, site / "kvserve",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (site / "optimum").mkdir()
    (site / "optimum" / "__init__.py").write_text("")
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "KVSERVE_WIKITEXT": ""}

    def run(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "kvserve", *args], cwd=work, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    probe = subprocess.run([sys.executable, "-c", "import kvserve; print(kvserve.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip().startswith(str(site))  # the copy, not the checkout
    # What depends on the package's own files (the bundled text, the kernels' sources, the
    # dashboard) is reached by one small run of each command; eval's rows are tested in tests/eval.
    run("eval", "--formats", "int8,fp8_e4m3", "--kv-fp8-scales", "head", "--windows", "1", "--window-len", "32",
        "--stride", "32", "--greedy-prompts", "0", "--passkey-lengths", "", "--out", "ev")
    report = (work / "ev" / "eval.md").read_text()
    assert "### Python reference docs (pydoc_data)" in report and "kvserve int8 |" in report
    assert "512 tokens of calibration." in report and "kvserve fp8_e4m3 |" in report
    assert "HF QuantizedCache rows skipped: optimum.quanto is not installed" in report
    run("bench", "throughput", "--num-requests", "2", "--skip-hf", "--skip-llama-cpp", "--skip-contiguous",
        "--out", "bt")
    assert (work / "bt" / "throughput.md").exists()
    doctor = json.loads(run("doctor", "--tokens", "16", "--formats", "", "--skip-performance", "--json"))
    assert doctor["text"].startswith("Python reference docs") and doctor["checks"]
