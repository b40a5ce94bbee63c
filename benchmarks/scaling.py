"""Time per token vs sequence length, cached vs no-cache vs HF: `python benchmarks/scaling.py --help`.

The same as `kvserve bench scaling`; the plot goes to bench_out/scaling.png."""
import sys

from kvserve.cli import main

main(["bench", "scaling", *sys.argv[1:]])
