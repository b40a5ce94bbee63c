"""HF transformers timed in a process of its own, with OpenMP's default spin.

The child loads the model once and runs the timing functions of `bench/hf_baseline.py` on it by
name (`HFProcess.run`), so that kvserve and HF can take turns.

`import kvserve` sets `GOMP_SPINCOUNT=1000` (kvserve/threads.py: on a shared machine torch's idle
OpenMP workers otherwise spin through kvserve's own kernels). A peer timed in the same process
would inherit it, and transformers' many short OpenMP regions then wake sleeping workers every
op: HF measured ~2x slower than in a process of its own (BENCHMARKS.md, issue 38). The child gets
libgomp's own default (300,000 spins), what HF runs with anywhere else, and keeps the model loaded
so that rounds can still take turns with kvserve.
"""
from __future__ import annotations

import multiprocessing
import os
from multiprocessing.connection import Connection

import torch

from kvserve.bench.metrics import RequestTiming
from kvserve.bench.workload import WorkloadRequest

# libgomp's default spin count when OMP_WAIT_POLICY is unset.
OPENMP_DEFAULT_SPINCOUNT = "300000"


# What the child may run: the timing functions of hf_baseline.py, each taking the model first.
RUNNABLE = ("hf_step_times", "run_hf_static_batches", "run_hf_continuous_batching")


def _serve(conn: Connection, source: str, dtype: torch.dtype, threads: int) -> None:
    from kvserve.bench import hf_baseline

    torch.set_num_threads(threads)
    model, tokenizer = hf_baseline.load_hf_bench_model(source, dtype)
    conn.send(tokenizer.pad_token_id or 0)
    while (request := conn.recv()) is not None:
        if request == "environment":  # what the child runs with, for the tests
            conn.send(dict(os.environ))
            continue
        name, args = request
        conn.send(getattr(hf_baseline, name)(model, *args))


class HFProcess:
    """`run(name, *args)`: hf_baseline's `name(model, *args)` in the child; `pad_token_id`: its
    tokenizer's (0 without one)."""

    def __init__(self, source: str, dtype: torch.dtype, threads: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        saved = os.environ.get("GOMP_SPINCOUNT")
        os.environ["GOMP_SPINCOUNT"] = OPENMP_DEFAULT_SPINCOUNT  # the child's environment, at spawn
        try:
            self._process = context.Process(target=_serve, args=(child, source, dtype, threads), daemon=True)
            self._process.start()
        finally:
            if saved is None:
                del os.environ["GOMP_SPINCOUNT"]
            else:
                os.environ["GOMP_SPINCOUNT"] = saved
        child.close()
        pad = self._recv()
        assert isinstance(pad, int)
        self.pad_token_id = pad

    def _recv(self) -> object:
        try:
            return self._conn.recv()
        except EOFError:
            raise RuntimeError(f"HF peer process died (exit code {self._process.exitcode})") from None

    def run(self, name: str, *args: object) -> object:
        if name not in RUNNABLE:
            raise ValueError(f"HF peer process: {name!r} is not one of {', '.join(RUNNABLE)}")
        self._conn.send((name, args))
        return self._recv()

    def batches(self, kind: str, requests: list[WorkloadRequest], batch_size: int
                ) -> tuple[list[RequestTiming], float]:
        """`kind` "static" (run_hf_static_batches) or "continuous" (HF's continuous batching): the
        requests' timings and the wall time."""
        if kind == "static":
            result = self.run("run_hf_static_batches", requests, batch_size, self.pad_token_id)
        else:
            result = self.run("run_hf_continuous_batching", requests, batch_size)
        assert isinstance(result, tuple)
        return result

    def step_times(self, prompt: list[int], num_tokens: int) -> list[float]:
        """Seconds each of `num_tokens` took, one sequence alone (`hf_step_times`)."""
        times = self.run("hf_step_times", prompt, num_tokens, 0)  # one sequence: nothing to pad
        assert isinstance(times, list)
        return times

    def environment(self) -> dict[str, str]:
        self._conn.send("environment")
        env = self._recv()
        assert isinstance(env, dict)
        return env

    def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(None)
            self._process.join(timeout=10)
        self._conn.close()
