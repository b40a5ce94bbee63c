"""The texts benchmarks and `kvserve eval` read, found without a download.

- `wikitext2`: the WikiText-2 raw test split. It is not redistributed with kvserve (its
  licenses, CC BY-SA 3.0 and GFDL, and its keeper ask that it stay out of the project): it is
  read from $KVSERVE_WIKITEXT, or from the checkout's `../shared/data/wikitext-2-raw/`.
- `python-docs`: the Python language reference's prose that ships inside every CPython
  (`pydoc_data.topics`, PSF license; about 465,000 characters of English with code samples).
- `calibration`: what start-up calibration reads by default (`kv_calibration_data`): CPython 3.11's
  `heapq`, `textwrap` and `bisect` modules as they ship (PSF license; about 46,000 characters of
  prose docstrings, comments and code), a text no evaluation reads, so that calibrated layouts are
  judged on text they were not fitted to. `shared_passage` finds an evaluation text that overlaps it.
- any other value: a path to a UTF-8 text file.

The default is `wikitext2` where it is found, else `python-docs`; every report names the text.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

TEXT_NAMES = ("wikitext2", "python-docs", "calibration")
_CALIBRATION = Path(__file__).with_name("calibration.txt")
_CHECKOUT_WIKITEXT = Path(__file__).resolve().parents[1].parent / "shared/data/wikitext-2-raw/wiki.test.raw"
DATA_HELP = ("text to read: wikitext2 (WikiText-2 test split, from $KVSERVE_WIKITEXT or ../shared), "
             "python-docs (the Python reference prose inside CPython), calibration (the calibration text), "
             "or a file path; "
             "default: wikitext2 where found, else python-docs")


@dataclass(frozen=True)
class Text:
    name: str   # what reports call it
    text: str


def wikitext_path() -> Path | None:
    env = os.environ.get("KVSERVE_WIKITEXT")
    path = Path(env) if env else _CHECKOUT_WIKITEXT
    return path if path.is_file() else None


def load_text(spec: str | None = None, max_chars: int | None = None, option: str = "--data") -> Text:
    """`spec` as in the module docstring; the first `max_chars` characters (all when None). Errors
    name `option`, the flag or field the user gave `spec` in."""
    if spec is None:
        spec = "wikitext2" if wikitext_path() is not None else "python-docs"
    if spec == "wikitext2":
        path = wikitext_path()
        if path is None:
            raise ValueError(f"{option}: WikiText-2 is not redistributed with kvserve; set KVSERVE_WIKITEXT to its "
                             "wiki.test.raw, or use python-docs or a file path")
        return Text("WikiText-2 (test)", _read(path, max_chars, option))
    if spec == "python-docs":
        from pydoc_data.topics import topics
        text = "\n\n".join(topics[key] for key in sorted(topics))
        return Text("Python reference docs (pydoc_data)", text if max_chars is None else text[:max_chars])
    if spec == "calibration":
        return Text("calibration text (CPython heapq, textwrap, bisect)", _read(_CALIBRATION, max_chars, option))
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"{option}: {spec!r} is not a file, nor one of {', '.join(TEXT_NAMES)}")
    return Text(path.name, _read(path, max_chars, option))


def shared_passage(text: str, other: str, probe: int = 64) -> str | None:
    """A passage of `probe` characters that `text` and `other` both contain, or None. Every passage
    of 1.5 x `probe` characters they share is found: the shorter text's probes are taken at every
    offset, the longer's every `probe // 2` characters, so one of those lies inside any such passage."""
    short, long = sorted((text, other), key=len)
    held = {short[i:i + probe] for i in range(len(short) - probe + 1)}
    return next((long[i:i + probe] for i in range(0, len(long) - probe + 1, probe // 2)
                 if long[i:i + probe] in held), None)


def _read(path: Path, max_chars: int | None, option: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read() if max_chars is None else f.read(max_chars)
    except UnicodeDecodeError as err:
        raise ValueError(f"{option}: {path} is not UTF-8 text (byte {err.start}: {err.reason}); give a text file") \
            from None
    except OSError as err:
        raise ValueError(f"{option}: cannot read {path} ({err.strerror})") from None
    if not text.strip():
        raise ValueError(f"{option}: {path} is empty")
    return text
