"""The soak benchmark's client and RSS sampling, on a tiny server for a few seconds."""
from __future__ import annotations

import os

from kvserve.bench.serve_load import ServerProcess
from kvserve.bench.soak import rss_mib, run_soak
from kvserve.bench.workload import WorkloadRequest


def test_rss_of_this_process_is_read_from_proc() -> None:
    assert 10 < rss_mib(os.getpid()) < 64 * 1024


def test_soak_counts_requests_and_samples_rss() -> None:
    server = ServerProcess("--model", "random:tiny", "--dtype", "float32", "--kv-cache-memory", "8MiB",
                           "--max-model-len", "256")
    try:
        requests = [WorkloadRequest(list(range(5, 5 + n)), 8) for n in (10, 40, 90)]
        result = run_soak(server.url, server.proc.pid, requests, concurrency=4, duration_s=4, hangup=0.3,
                          sample_s=1)
        state = server.kv_state()
    finally:
        server.stop()
    counts = result["counts"]
    assert counts["ok"] > 0 and counts["hung_up"] > 0 and counts["error"] == 0
    assert len(result["rss_mib"]) >= 4 and all(m > 0 for _, m in result["rss_mib"])
    assert sum(c in "US" for c in state["states"]) == 0  # hang-ups left no block behind
