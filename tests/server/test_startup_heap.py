"""The server's frozen startup heap (kvserve/server/startup_heap.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# In a child process: freezing is for the whole life of a process, and would keep this test
# worker's later garbage from the collector.
PROBE = """
import gc, json
from kvserve import LLM
from kvserve.server.startup_heap import freeze_startup_heap
from tests.conftest import TINY
llm = LLM(model=TINY, dtype="float32", device="cpu", kv_cache_memory="4MiB", max_model_len=256)
before = len(gc.get_objects())
freeze_startup_heap()
print(json.dumps({"before": before, "frozen": gc.get_freeze_count(), "left": len(gc.get_objects())}))
"""


def test_the_startup_heap_is_out_of_the_collectors_reach() -> None:
    """After the server's startup, what a full collection walks is what the requests make, not
    the engine: every object alive then (the engine among them) is frozen."""
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["before"] > 50_000  # the engine, torch and the rest of the startup heap
    assert counts["frozen"] >= counts["before"] * 0.9 and counts["left"] < 1_000
