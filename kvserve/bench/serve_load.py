"""Load check: many concurrent streaming requests against `kvserve serve` in another process,
then the same requests through offline `LLM.generate`."""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from typing import Any

import httpx

from kvserve.bench.workload import WorkloadRequest
from kvserve.net import free_loopback_port


class ServerProcess:
    """`kvserve serve` on a free loopback port; ready once /health answers."""

    def __init__(self, *args: str, start_timeout: float = 180) -> None:
        self.port = free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve", "serve", "--port", str(self.port), "--log-level", "warning", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")  # type: ignore[union-attr]
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not come up in {start_timeout:.0f} s")

    def kv_state(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/kv/state", timeout=30).json()

    def stop(self) -> None:
        """SIGTERM: the server finishes what runs, then exits."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def _stream_one(client: httpx.AsyncClient, url: str, request: WorkloadRequest, delay: float) -> dict[str, Any]:
    await asyncio.sleep(delay)
    body = {"prompt": request.prompt_token_ids, "max_tokens": request.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    tokens, finish, error = 0, None, None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"}
            # Parsing every chunk would make this process compete with the server for the CPU;
            # the last events (finish reason, usage) say what the request produced.
            tail = b""
            async for raw in response.aiter_raw():
                first = first or time.perf_counter()
                tail = (tail + raw)[-4096:]
        events = [json.loads(e[6:]) for e in tail.decode(errors="replace").split("\n\n")
                  if e.startswith("data: {")]
        for chunk in events:
            if "error" in chunk:
                error = chunk["error"]["message"]
            elif chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"]:
                finish = chunk["choices"][0]["finish_reason"] or finish
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        error = f"{type(err).__name__}: {err}"
    if error is None and (finish != "length" or tokens != request.max_tokens):
        error = f"finished {finish!r} after {tokens} of {request.max_tokens} tokens"
    end = time.perf_counter()
    return {"error": error, "tokens": tokens, "ttft": (first or end) - t0, "e2e": end - t0}


async def _run(url: str, requests: list[WorkloadRequest]) -> tuple[list[dict[str, Any]], float]:
    limits = httpx.Limits(max_connections=len(requests) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        # A few ms apart, so they reach the server in list order, the order offline runs them in:
        # with lognormal lengths the order alone moves throughput by 10-15% (BENCHMARKS.md).
        results = await asyncio.gather(*(_stream_one(client, url, r, 0.005 * i) for i, r in enumerate(requests)))
        return list(results), time.perf_counter() - t0


def run_concurrent_streams(url: str, requests: list[WorkloadRequest]) -> tuple[list[dict[str, Any]], float]:
    """All requests at once, each a streaming completion; returns per-request results and wall time."""
    return asyncio.run(_run(url, requests))
