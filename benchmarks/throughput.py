"""Offline throughput, kvserve vs HF transformers: `python benchmarks/throughput.py --help`.

The same as `kvserve bench throughput`; results go to bench_out/ and BENCHMARKS.md."""
import sys

from kvserve.cli import main

main(["bench", "throughput", *sys.argv[1:]])
