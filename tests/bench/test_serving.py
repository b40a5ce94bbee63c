"""Serving metrics with vLLM's definitions, against streams timed by hand; the send schedule's
shape; and the client against a real `kvserve serve`."""
from __future__ import annotations

import argparse
import contextlib
import gc
import http.server
import json
import math
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvserve.bench.serve_load import ServerProcess
from kvserve.bench.serving import StreamRecord, parse_goodput, run_load, send_times, summarize
from kvserve.bench.workload import WorkloadRequest

# A: sent at 0, tokens at 0.1, 0.3, 0.6 s: TTFT 100 ms, E2EL 600, TPOT (600 - 100) / 2 = 250, ITL 200, 300.
# B: sent at 1.0, one token at 1.05: TTFT 50, E2EL 50, no TPOT, no ITL. C: failed.
RECORDS = [StreamRecord(0.0, (0.1, 0.3, 0.6), prompt_tokens=10, output_tokens=3),
           StreamRecord(1.0, (1.05,), prompt_tokens=20, output_tokens=1),
           StreamRecord(1.5, (), prompt_tokens=30, output_tokens=0, error="HTTP 500")]


def test_the_metrics_follow_vllms_definitions() -> None:
    s = summarize(RECORDS, duration_s=2.0)
    assert (s.completed, s.failed) == (2, 1)
    assert s.request_throughput == 1.0 and s.output_tok_s == 2.0 and s.total_tok_s == (4 + 30) / 2
    assert s.ms["ttft"]["mean"] == pytest.approx(75) and s.ms["ttft"]["p50"] == pytest.approx(75)
    assert s.ms["ttft"]["p99"] == pytest.approx(50 + 0.99 * 50)  # linear interpolation between 50 and 100
    assert s.ms["tpot"]["p50"] == pytest.approx(250) and s.ms["e2el"]["p90"] == pytest.approx(50 + 0.9 * 550)
    assert s.ms["itl"]["mean"] == pytest.approx(250) and s.ms["itl"]["p50"] == pytest.approx(250)
    assert s.goodput is None


@pytest.mark.parametrize(("slos", "goodput"), [
    ({"ttft": 80}, 0.5),                  # B alone is first within 80 ms
    ({"ttft": 200, "tpot": 260}, 1.0),    # both; B has no TPOT to miss
    ({"ttft": 200, "tpot": 240}, 0.5),    # A's 250 ms per token misses
    ({"e2el": 600}, 1.0), ({"e2el": 599}, 0.5),
])
def test_goodput_counts_completed_requests_meeting_every_slo(slos: dict, goodput: float) -> None:
    assert summarize(RECORDS, duration_s=2.0, slos=slos).goodput == pytest.approx(goodput)


def test_goodput_slos_are_read_as_vllm_writes_them() -> None:
    assert parse_goodput("ttft:500 tpot:50.5") == {"ttft": 500.0, "tpot": 50.5}
    for bad in ("itl:5", "ttft", "ttft:fast", "tpot:0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_goodput(bad)


@pytest.mark.parametrize(("burstiness", "cv"), [(1.0, 1.0), (4.0, 0.5), (0.25, 2.0)])
def test_send_times_have_the_rate_and_the_burstiness_asked(burstiness: float, cv: float) -> None:
    """Gamma gaps of shape k: mean 1 / rate, coefficient of variation 1 / sqrt(k); seeded."""
    sends = send_times(20_000, request_rate=8.0, burstiness=burstiness, seed=3)
    gaps = np.diff(sends)
    assert sends[0] == 0.0 and sends == send_times(20_000, 8.0, burstiness, seed=3)
    assert gaps.mean() == pytest.approx(1 / 8, rel=0.05) and gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)
    assert send_times(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess("--kv-cache-memory", "64MiB", "--max-model-len", "256")
    yield srv
    srv.stop()


def test_the_client_times_every_token_of_a_real_server(server: ServerProcess) -> None:
    """Six requests, at most two in flight: every one completes with one chunk per token (kvserve
    streams each token), and the third waits for a free slot, so it is sent later."""
    requests = [WorkloadRequest(list(range(5 + i, 25 + i)), 8) for i in range(6)]
    records, duration = run_load(server.url, [[r] for r in requests], max_concurrency=2)
    assert all(r.error is None and r.output_tokens == 8 and len(r.chunk_times) == 8 for r in records)
    assert all(0 < r.ttft <= r.e2el <= duration for r in records)
    assert min(r.sent for r in records[2:]) > max(r.sent for r in records[:2])
    s = summarize(records, duration, {"ttft": 60_000})
    assert s.completed == 6 and s.goodput == pytest.approx(6 / duration)



def test_the_load_options_are_read_as_vllm_names_them() -> None:
    from kvserve.cli import build_parser

    args = build_parser().parse_args(["bench", "serve", "--request-rate", "inf", "--burstiness", "0.5",
                                      "--max-concurrency", "4", "--goodput", "ttft:500 tpot:50"])
    assert (args.request_rate, args.burstiness, args.max_concurrency) == ([math.inf], 0.5, 4)
    assert args.goodput == {"ttft": 500.0, "tpot": 50.0}
    assert build_parser().parse_args(["bench", "serve", "--request-rate", "2.5"]).request_rate == [2.5]
    assert build_parser().parse_args(["bench", "serve", "--request-rate", "1,4,inf"]).request_rate == [1, 4, math.inf]
    for flags in (["--request-rate", "0"], ["--burstiness", "-1"], ["--max-concurrency", "0"], ["--goodput", "x:1"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "serve", *flags])


def test_bench_serve_measures_a_server_already_running(server: ServerProcess, tmp_path: Path) -> None:
    """--url: no server started, no offline peer; the workload goes to the given server, naming the
    model it serves."""
    import httpx

    from kvserve.cli import main

    name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    main(["bench", "serve", "--url", server.url, "--served-model-name", name, "--num-requests", "3",
          "--prompt-len-median", "12", "--output-len-median", "4", "--kv-cache-memory", "32MiB",
          "--max-model-len", "256", "--out", str(tmp_path)])
    report = (tmp_path / "serve_load.md").read_text()
    assert f"the server at {server.url}" in report and "3 completed, 0 failed" in report
    assert "offline" not in report


def test_a_server_that_sends_no_usage_is_counted_one_token_per_chunk() -> None:
    """A stand-in OpenAI stream of five text chunks, 100 ms apart, and no usage chunk (as some
    servers send): five tokens, four gaps, no error. On a loaded machine the client may read
    several chunks at once, so only the gaps' sum is bounded: chunks 400 ms apart from first to
    last cannot all arrive in one read unless the client stalls that long."""
    import time

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for word in ["a", "b", "c", "d", "e"]:
                chunk = {"choices": [{"text": word, "index": 0, "finish_reason": None}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.1)
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        [record], _ = run_load(f"http://127.0.0.1:{httpd.server_port}", [[WorkloadRequest([1, 2, 3], 5)]])
    finally:
        httpd.shutdown()
    assert record.error is None and record.output_tokens == 5 and len(record.itls) == 4
    assert all(gap >= 0 for gap in record.itls) and 0.1 < sum(record.itls) < 2


@contextlib.contextmanager
def one_token_server(answers: Callable[[http.server.BaseHTTPRequestHandler], bool]) -> Iterator[str]:
    """A stand-in streaming server on a free port (its URL): each request streams one token,
    unless `answers(handler)`, called first, returns False: then it closes the connection unanswered."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            if not answers(self):
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            chunk = {"choices": [{"text": "a", "index": 0, "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}"
    finally:
        httpd.shutdown()


def test_a_request_the_server_dropped_unanswered_is_sent_again() -> None:
    """A stand-in server closes the first connection without a response, as a server does with
    a kept-alive connection when its idle timeout races the next request: the client sends the
    request again and it completes, its time counted from the first send; a second drop is an error."""
    drops = {"left": 1}

    def answers(_: http.server.BaseHTTPRequestHandler) -> bool:
        drops["left"] -= 1
        return drops["left"] < 0

    with one_token_server(answers) as url:
        [record], _ = run_load(url, [[WorkloadRequest([1, 2, 3], 1)]])
        assert record.error is None and record.output_tokens == 1
        drops["left"] = 2
        [record], _ = run_load(url, [[WorkloadRequest([1, 2, 3], 1)]])
        assert record.error is not None and "Server disconnected" in record.error


def test_a_sweep_runs_each_rate_on_its_own_draw_and_draws_the_curve(server: ServerProcess, tmp_path: Path) -> None:
    import httpx

    from kvserve.cli import main

    name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    main(["bench", "serve", "--url", server.url, "--served-model-name", name, "--num-requests", "3",
          "--prompt-len-median", "12", "--output-len-median", "4", "--request-rate", "50,inf",
          "--kv-cache-memory", "32MiB", "--max-model-len", "256", "--out", str(tmp_path)])
    report = (tmp_path / "serve_load.md").read_text()
    assert report.count("3 completed, 0 failed") == 2 and "at 50.0 req/s" in report and "at inf req/s" in report
    table = [line for line in report.splitlines() if line.startswith("| 50 |") or line.startswith("| inf |")]
    assert len(table) == 2 and (tmp_path / "serve_sweep.png").stat().st_size > 0


def test_the_sweep_table_reads_each_summary() -> None:
    from kvserve.bench.serving import ServingSummary
    from kvserve.bench.serving_sweep import sweep_table

    ms = {"ttft": {"mean": 0, "p50": 120.4, "p90": 0, "p99": 480.6}, "tpot": {"mean": 0, "p50": 20.04, "p90": 0,
                                                                          "p99": 35.06}}
    rows = [(2.0, ServingSummary(10, 0, 5.0, 2.0, 64.0, 300.0, None, ms)),
            (math.inf, ServingSummary(10, 1, 2.5, 4.0, 128.0, 600.0, 3.5, ms))]
    assert sweep_table(rows)[2:] == ["| 2 | 2.00 | 64.0 | 120 / 481 | 20.0 / 35.1 | - |",
                                     "| inf | 4.00 | 128.0 | 120 / 481 | 20.0 / 35.1 | 3.50 |"]


def test_the_collector_pauses_only_between_runs() -> None:
    """The client shares the machine with the server it measures: while its streams run the
    collector is off (a stand-in server reads the state mid-request), and afterwards it is back as
    the caller had it."""
    seen: list[bool] = []

    def answers(_: http.server.BaseHTTPRequestHandler) -> bool:
        seen.append(gc.isenabled())  # the same process: the client's own collector
        return True

    with one_token_server(answers) as url:
        assert gc.isenabled()
        run_load(url, [[WorkloadRequest([1, 2, 3], 1)]])
        assert seen == [False] and gc.isenabled()
        gc.disable()
        try:
            run_load(url, [[WorkloadRequest([1, 2, 3], 1)]])
            assert seen == [False, False] and not gc.isenabled()  # a caller's choice is kept
        finally:
            gc.enable()
