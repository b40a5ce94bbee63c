#!/usr/bin/env bash
# A virtual environment for NVIDIA's kvpress (PyPI kvpress 0.5.5), the peer of `kvserve eval
# --evictions`: kvpress needs transformers < 5.3, kvserve runs 5.x, so it lives apart and eval
# calls benchmarks/kvpress_run.py inside it as a subprocess. Prints the environment's python.
set -euo pipefail
cd "$(dirname "$0")/.."
env=".venv-kvpress"
if [ ! -x "$env/bin/python" ]; then
    python3 -m venv "$env"
    # The CPU torch wheel, pinned as in pyproject.toml (an unpinned one pulls a CUDA build).
    "$env/bin/pip" install -q "torch==2.13.0"
    "$env/bin/pip" install -q "kvpress==0.5.5" "transformers>=4.56,<5.3"
fi
echo "$PWD/$env/bin/python"
