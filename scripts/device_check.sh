#!/usr/bin/env bash
# The GPU checks, as one call of the `device` tool (a lent H200: torch and triton are there,
# nothing can be downloaded, the bundled GGUF is not carried):
#   run(command="bash scripts/device_check.sh", timeout_s=560)
# CUDA runs of the engine, cache and attention tests (the real-model tests need the GGUF: not
# here), then benchmarks/gpu.py. Logs and gpu.json come back in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
out="${OUT:-bench_out}"
mkdir -p "$out"
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 240 python3 -m pytest -q -x -m "not model and not slow" tests/attention tests/cache tests/engine tests/kernels \
    2>&1 | tee "$out/tests.log" | tail -30
timeout 280 python3 benchmarks/gpu.py --out "$out" 2>&1 | tee "$out/bench.log" | tail -40
