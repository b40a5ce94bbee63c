#!/usr/bin/env bash
# The GPU checks, as one call of the `device` tool (a lent H200: torch and triton are there,
# nothing can be downloaded, the bundled GGUF is not carried):
#   run(command="bash scripts/device_check.sh", timeout_s=560)
# 1. the CUDA-graph and async-scheduling tests (their results decide whether the benchmark runs
#    with graphs and with async scheduling);
# 2. benchmarks/gpu.py (kvserve with and without graphs, HF continuous batching);
# 3. the Triton kernels compiled for the GPU against the dense reference, and the engine's
#    backend tests on CUDA (the real-model tests need the GGUF: not here).
# Logs, profiles and gpu.json come back in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
out="${OUT:-bench_out}"
mkdir -p "$out"
nvidia-smi -L
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"
graphs=""
timeout "${GRAPH_TEST_S:-100}" python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_cuda_graphs.py \
    2>&1 | tee "$out/tests_graphs.log" | tail -15 || graphs="--no-cuda-graphs"
overlap=""
timeout "${ASYNC_TEST_S:-60}" python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_async_scheduling.py -k cuda \
    2>&1 | tee "$out/tests_async.log" | tail -5 || overlap="--async-scheduling off"
timeout "${BENCH_S:-250}" python3 benchmarks/gpu.py --out "$out" $graphs $overlap 2>&1 | tee "$out/bench.log" | tail -60
timeout "${TEST_S:-120}" python3 -m pytest -q -p no:cacheprovider -m "not model" tests/attention/test_backends.py \
    tests/engine/test_attention_backends.py 2>&1 | tee "$out/tests.log" | tail -25
