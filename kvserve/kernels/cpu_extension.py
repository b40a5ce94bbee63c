"""Builds (once, then cached) and loads the C++ CPU kernels in `csrc/`.

The extension is compiled with the machine's own instruction set, so the build directory is
keyed by the sources' hash and the CPU's feature flags: a cache copied to another CPU rebuilds
instead of crashing. The sources are compiled from copies inside that directory: ninja rebuilds
whenever a source's *path* changes, so compiling it where the package lies would rebuild for
every install, virtual environment or copy of the same version that shares the cache. Without a
C++ compiler, `load()` returns None and callers use the eager torch paths.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from types import ModuleType

from kvserve.paths import cache_root

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
# Measured: 73-80 s on 2 idle cores (Intel Sapphire Rapids, AMD Zen 3), 241 s beside a test run.
BUILD_ESTIMATE = "one-time, about 1-2 minutes on 2 idle cores, longer on a busy machine"
PROGRESS_PERIOD = 30.0
SOURCES = tuple(sorted([*_CSRC.glob("*.cpp"), *_CSRC.glob("*.h")]))


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def build_dir() -> Path:
    text = b"".join(path.name.encode() + path.read_bytes() for path in SOURCES)
    key = hashlib.sha256(text + _cpu_flags().encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"cpu-{key}"


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernels, or None where they cannot be built (reason logged once)."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        logger.warning("kvserve: no C++ compiler found; CPU kernels off (eager torch ops instead)")
        return None
    from torch.utils import cpp_extension
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    sources = [_stable_copy(directory, path) for path in SOURCES]
    fresh = not any(directory.glob("*.so"))
    if fresh:
        logger.warning("kvserve: compiling the CPU kernels once into %s (%s)", directory, BUILD_ESTIMATE)
    start = time.perf_counter()
    done = threading.Event()
    if fresh:
        threading.Thread(target=_report_progress, args=(done, start), daemon=True).start()
    try:
        module = cpp_extension.load(
            name="kvserve_cpu_kernels", sources=[str(s) for s in sources if s.suffix == ".cpp"],
            build_directory=str(directory),
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except (RuntimeError, OSError) as err:
        logger.warning("kvserve: building the CPU kernels failed (%s); eager torch ops instead", err)
        return None
    finally:
        done.set()
    if fresh:
        logger.warning("kvserve: CPU kernels built in %.0f s", time.perf_counter() - start)
    return module


def _report_progress(done: threading.Event, start: float) -> None:
    """A line every PROGRESS_PERIOD seconds while the compiler runs (it prints nothing itself)."""
    while not done.wait(PROGRESS_PERIOD):
        logger.warning("kvserve: still compiling the CPU kernels (%.0f s so far)", time.perf_counter() - start)


def _stable_copy(directory: Path, source: Path) -> Path:
    """`source` copied into `directory` (named by the sources' hash, so an existing copy is the
    same text); written beside and renamed, so a concurrent build never reads half a file."""
    copy = directory / source.name
    if not copy.exists():
        partial = directory / f".{source.name}.{os.getpid()}"
        shutil.copyfile(source, partial)
        os.replace(partial, copy)
    return copy
