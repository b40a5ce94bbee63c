"""Serving load as `vllm bench serve` measures it: requests sent at a rate (Poisson, or gamma with a
burstiness) or at most N at once, every streamed chunk timed by the client, and the metrics with
vLLM's definitions:

- TTFT: from sending a request to its first streamed token;
- TPOT, per request: (end-to-end latency - TTFT) / (output tokens - 1), for requests of 2+ tokens;
- ITL: every gap between two streamed chunks of a request, pooled over requests;
- E2EL: from sending to the last chunk;
- goodput (DistServe): completed requests per second that meet every given SLO (`--goodput
  ttft:MS tpot:MS e2el:MS`), over the run's duration (first send to last completion).

Percentiles are numpy's (linear interpolation), as vLLM reports them. The client is the same for
any OpenAI-compatible server (`/v1/completions`, streaming, EOS ignored), so a peer's numbers are
measured the same way; only the prompt's fields may differ (`PromptFields`: token ids and
`ignore_eos` as vLLM takes them, or what a server that takes neither needs, bench/serve_peers.py).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from kvserve.arg_types import at_least, number
from kvserve.bench.workload import WorkloadRequest

SLO_NAMES = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)

# A request's prompt and EOS fields in the body a server takes.
PromptFields = Callable[[WorkloadRequest], dict[str, Any]]


def token_id_prompt(request: WorkloadRequest) -> dict[str, Any]:
    """vLLM's fields, which kvserve and llama-server take: the prompt as token ids, EOS ignored."""
    return {"prompt": request.prompt_token_ids, "ignore_eos": True}


@dataclass(frozen=True)
class StreamRecord:
    """One request as the client saw it; times in seconds on one clock. `chunk_times`: when each
    streamed chunk carrying tokens arrived."""
    sent: float
    chunk_times: tuple[float, ...]
    prompt_tokens: int
    output_tokens: int
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1] - self.sent

    @property
    def tpot(self) -> float | None:
        return None if self.output_tokens < 2 else (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


@dataclass(frozen=True)
class ServingSummary:
    completed: int
    failed: int
    duration_s: float
    request_throughput: float   # completed requests / s
    output_tok_s: float
    total_tok_s: float          # prompt and output tokens of completed requests / s
    goodput: float | None       # requests / s meeting every SLO; None without SLOs
    ms: dict[str, dict[str, float]]  # metric -> {"mean", "p50", "p90", "p99"}, milliseconds


def parse_goodput(text: str) -> dict[str, float]:
    """`ttft:500 tpot:50` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds), as vLLM's --goodput."""
    slos = {}
    for item in text.split():
        name, _, value = item.partition(":")
        if name not in SLO_NAMES:
            raise argparse.ArgumentTypeError(f"{item!r}: an SLO is one of {', '.join(SLO_NAMES)}, as ttft:MS")
        try:
            slos[name] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: milliseconds after the colon, as {name}:500") from None
        if not slos[name] > 0:
            raise argparse.ArgumentTypeError(f"{item!r}: an SLO must be positive")
    if not slos:
        raise argparse.ArgumentTypeError("no SLO given: write them as 'ttft:500 tpot:50'")
    return slos


def summarize(records: list[StreamRecord], duration_s: float, slos: dict[str, float] | None = None) -> ServingSummary:
    ok = [r for r in records if r.error is None]

    def stats(values: list[float]) -> dict[str, float]:
        if not values:
            return {"mean": math.nan, **{f"p{q}": math.nan for q in PERCENTILES}}
        ms = np.asarray(values) * 1000
        return {"mean": float(ms.mean()), **{f"p{q}": float(np.percentile(ms, q)) for q in PERCENTILES}}

    tpots = [t for r in ok if (t := r.tpot) is not None]
    ms = {"ttft": stats([r.ttft for r in ok]), "tpot": stats(tpots),
          "itl": stats([x for r in ok for x in r.itls]), "e2el": stats([r.e2el for r in ok])}
    goodput = None
    if slos:
        def meets(r: StreamRecord) -> bool:
            tpot = r.tpot if r.tpot is not None else 0.0  # one token: no time per output token to miss
            values = {"ttft": r.ttft, "tpot": tpot, "e2el": r.e2el}
            return all(values[name] * 1000 <= limit for name, limit in slos.items())
        goodput = sum(map(meets, ok)) / duration_s
    out_tokens = sum(r.output_tokens for r in ok)
    return ServingSummary(len(ok), len(records) - len(ok), duration_s, len(ok) / duration_s, out_tokens / duration_s,
                          (out_tokens + sum(r.prompt_tokens for r in ok)) / duration_s, goodput, ms)


def send_times(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each of `n` requests is sent: all at 0 for an infinite
    rate; else gaps drawn from a gamma distribution of mean 1 / rate and shape `burstiness` (1: a
    Poisson process; below 1 burstier, above steadier), as vLLM's benchmark draws them."""
    if math.isinf(request_rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(burstiness, 1 / (request_rate * burstiness), size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist()


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], request: WorkloadRequest
                  ) -> StreamRecord:
    sent = time.perf_counter()
    record = await _attempt(client, url, body, request, sent)
    if record.error is not None and record.error.startswith(_DROPPED):
        # A kept-alive connection the server closed as the request went out: nothing reached it,
        # so the client sends again, as an HTTP client retries an unanswered request on a reused
        # connection. The lost time still counts (the request's clock started at `sent`).
        record = await _attempt(client, url, body, request, sent)
    return record


# httpx's error for a connection closed before any byte of the response.
_DROPPED = "RemoteProtocolError: Server disconnected without sending a response"


async def _attempt(client: httpx.AsyncClient, url: str, body: dict[str, Any], request: WorkloadRequest,
                   sent: float) -> StreamRecord:
    times: list[float] = []
    tokens, error, pending = 0, None, b""
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:200]
                return StreamRecord(sent, (), len(request.prompt_token_ids), 0, f"HTTP {response.status_code}: {text}")
            async for raw in response.aiter_raw():
                now = time.perf_counter()
                pending += raw
                *events, pending = pending.split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: {"):
                        continue
                    chunk = json.loads(event[6:])
                    if "error" in chunk:
                        error = chunk["error"].get("message", str(chunk["error"]))
                    elif chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    elif chunk.get("choices") and chunk["choices"][0].get("text"):
                        times.append(now)
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        error = f"{type(err).__name__}: {err}"
    if error is None and not times:
        error = "no token streamed"
    if tokens == 0 and error is None:  # a server that sends no usage chunk: one token per chunk
        tokens = len(times)
    if error is None and tokens != request.max_tokens:
        error = f"{tokens} of {request.max_tokens} tokens"
    return StreamRecord(sent, tuple(times), len(request.prompt_token_ids), tokens, error)


def _body(request: WorkloadRequest, model: str | None, prompt_fields: PromptFields) -> dict[str, Any]:
    return {**prompt_fields(request), "max_tokens": request.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **({"model": model} if model else {})}


async def _load(url: str, model: str | None, sessions: list[list[WorkloadRequest]], sends: list[float],
                max_concurrency: int | None, prompt_fields: PromptFields) -> tuple[list[StreamRecord], float]:
    most = max_concurrency or sum(map(len, sessions))
    gate = asyncio.Semaphore(most)
    # Bodies made before the clock starts: a prompt decoded to text costs the client, not the server.
    bodies = [[_body(r, model, prompt_fields) for r in session] for session in sessions]
    # Idle connections are closed after 2 s, before a server's own keep-alive timeout (llama-server's
    # HTTP library: 5 s, httpx's default expiry too) can close one as a request goes out on it.
    limits = httpx.Limits(max_connections=most + 8, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        start = time.perf_counter()

        async def one(session: list[WorkloadRequest], session_bodies: list[dict[str, Any]], at: float
                      ) -> list[StreamRecord]:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            records = []
            # A chat's next turn waits for the answer to the last.
            for request, body in zip(session, session_bodies):
                async with gate:
                    records.append(await _stream(client, url, body, request))
            return records
        done = await asyncio.gather(*(one(s, b, at) for s, b, at in zip(sessions, bodies, sends)))
        return [r for records in done for r in records], time.perf_counter() - start


def run_load(url: str, sessions: list[list[WorkloadRequest]], request_rate: float = math.inf,
             burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
             model: str | None = None, prompt_fields: PromptFields = token_id_prompt
             ) -> tuple[list[StreamRecord], float]:
    """Starts each session at `send_times` (the rate counts sessions: a single-request session
    per request, or a chat), its requests one after another, at most `max_concurrency` requests in
    flight; returns every request's record, session by session, and the run's duration."""
    sends = send_times(len(sessions), request_rate, burstiness, seed)
    # The client shares the machine with the server it measures, and a full collection here (it
    # walks the offline engine this process built: 120 ms) took a core from the server mid-run.
    # Cyclic garbage of the run waits until it ends.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return asyncio.run(_load(url, model, sessions, sends, max_concurrency, prompt_fields))
    finally:
        if collecting:
            gc.enable()


def _rate(text: str) -> float:
    """Requests per second: a number > 0, or inf (all at once), as vLLM reads it."""
    return math.inf if text.strip().lower() == "inf" else number(above=0)(text)


def _rates(text: str) -> list[float]:
    """One rate, or several separated by commas (a sweep)."""
    return [_rate(part) for part in text.split(",")]


def add_load_args(p: argparse.ArgumentParser) -> None:
    """How requests are sent, as `vllm bench serve` names it."""
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=_rates, default=[math.inf],
                   help="requests per second, sent at gamma-distributed gaps (default inf: all at once); several "
                        "separated by commas sweep them: each rate runs the workload drawn with its own seed (other "
                        "slices of the text, so no run reuses another's prefixes), and the report adds a table and "
                        "a plot of latency against throughput")
    g.add_argument("--burstiness", type=number(above=0), default=1.0,
                   help="shape of the gaps' gamma distribution: 1 a Poisson process, below 1 burstier (default 1)")
    g.add_argument("--max-concurrency", type=at_least(1), default=None,
                   help="requests in flight at most; the others wait to be sent (default: no limit)")
    g.add_argument("--url", default=None,
                   help="an OpenAI-compatible server already running (e.g. http://host:8000): measure it instead of "
                        "starting kvserve serve; prompts are token ids of --model's tokenizer, which it must share")
    g.add_argument("--served-model-name", default=None, help="with --url: the request body's model field")
    g.add_argument("--goodput", type=parse_goodput, default=None, metavar="'ttft:MS tpot:MS e2el:MS'",
                   help="SLOs in milliseconds; goodput counts the requests per second that meet them all")


def format_summary(name: str, s: ServingSummary) -> list[str]:
    """Rows of vLLM's report, one per line, for a run named `name`."""
    lines = [f"**{name}**: {s.completed} completed, {s.failed} failed in {s.duration_s:.1f} s; "
             f"{s.request_throughput:.2f} req/s, output {s.output_tok_s:.1f} tok/s, total {s.total_tok_s:.1f} tok/s"
             + ("" if s.goodput is None else f", goodput {s.goodput:.2f} req/s"), "",
             "| ms | mean | p50 | p90 | p99 |", "|---|---|---|---|---|"]
    lines += [f"| {metric.upper()} | " + " | ".join(f"{v[k]:.1f}" for k in ("mean", "p50", "p90", "p99")) + " |"
              for metric, v in s.ms.items()]
    return lines
