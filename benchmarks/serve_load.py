"""Load check of the HTTP server: `python benchmarks/serve_load.py --help`.

The same as `kvserve bench serve`: 200 concurrent streaming requests from this process against
`kvserve serve` in another, then the same requests offline; results go to bench_out/."""
import sys

from kvserve.cli import main

main(["bench", "serve", *sys.argv[1:]])
