"""Where kvserve keeps what it builds once: converted models, compiled kernels."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`KVSERVE_CACHE`, else `$XDG_CACHE_HOME/kvserve` (default ~/.cache/kvserve)."""
    return Path(os.environ.get("KVSERVE_CACHE",
                               Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvserve"))
