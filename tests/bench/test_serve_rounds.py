"""`kvserve bench serve --rounds`: the servers take turns round by round, and the comparison gives
medians over rounds and medians of each round's ratios, checked against values worked by hand.
The orchestration runs here with stand-in servers and client: nothing is started."""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvserve.bench import serve_load
from kvserve.bench.serve_peers import Peer, Skipped
from kvserve.bench.serve_rounds import RATIOS, comparison_table, median_ratio, median_summary, round_order
from kvserve.bench.serving import ServingSummary, StreamRecord, token_id_prompt
from kvserve.cli import build_parser

STATS = ("mean", "p50", "p90", "p99")


def summary(out: float, p99: float, goodput: float | None = None, completed: int = 10,
            failed: int = 0) -> ServingSummary:
    """A run whose output tok/s is `out`, every latency percentile `p99` ms (TPOT a tenth), the
    other fields derived from `out` so that their medians follow it."""
    ms = {"ttft": dict.fromkeys(STATS, p99), "tpot": dict.fromkeys(STATS, p99 / 10),
          "itl": dict.fromkeys(STATS, p99 / 10), "e2el": dict.fromkeys(STATS, 2 * p99)}
    return ServingSummary(completed, failed, 100 / out, out / 50, out, 3 * out, goodput, ms)


def test_every_server_runs_once_a_round_in_turn() -> None:
    assert round_order(["kvserve", "llama-server", "transformers"], 2) == [
        (0, "kvserve"), (0, "llama-server"), (0, "transformers"),
        (1, "kvserve"), (1, "llama-server"), (1, "transformers")]
    assert round_order(["kvserve"], 3) == [(0, "kvserve"), (1, "kvserve"), (2, "kvserve")]


def test_the_median_of_rounds_takes_each_metric_apart() -> None:
    runs = [summary(100, 30, goodput=1.0, completed=10, failed=0),
            summary(80, 50, goodput=0.5, completed=8, failed=2),
            summary(120, 40, goodput=0.7, completed=9, failed=1)]
    m = median_summary(runs)
    assert (m.completed, m.failed) == (9, 1)
    assert (m.output_tok_s, m.total_tok_s, m.request_throughput) == (100, 300, 2.0)
    assert m.duration_s == pytest.approx(1.0)  # 100 / out: 1.25, 1.0, 0.833
    assert m.goodput == 0.7 and m.ms["ttft"]["p99"] == 40 and m.ms["e2el"]["p50"] == 80
    # Two rounds: floats between the middle two, counts the lower one (a count a round had).
    two = median_summary(runs[:2])
    assert (two.output_tok_s, two.ms["tpot"]["p99"], two.completed, two.failed) == (90, 4.0, 8, 0)


def test_a_median_without_values_stays_unknown() -> None:
    runs = [summary(100, 30, goodput=1.0), summary(80, 50, goodput=None)]
    for s in runs:
        s.ms["tpot"].update(dict.fromkeys(STATS, math.nan))  # every request one token long
    m = median_summary(runs)
    assert m.goodput is None and math.isnan(m.ms["tpot"]["p99"])


def test_a_ratio_is_the_median_of_each_rounds_ratio() -> None:
    ours = [summary(100, 300), summary(80, 200), summary(120, 500)]
    peer = [summary(40, 600), summary(50, 100), summary(100, 1000)]
    # Rounds' ratios 2.5, 1.6, 1.2: median 1.6 (the medians' ratio, 100 / 50 = 2, is not asked).
    assert median_ratio(ours, peer, RATIOS["output tok/s"]) == pytest.approx(1.6)
    # TTFT p99: 0.5, 2.0, 0.5.
    assert median_ratio(ours, peer, RATIOS["TTFT p99"]) == pytest.approx(0.5)
    zero = [summary(40, 600, goodput=0.0), summary(50, 100, goodput=1.0), summary(100, 1000, goodput=1.0)]
    assert median_ratio(ours, zero, RATIOS["goodput"]) is None  # goodput without SLOs, or 0 for the peer


def test_the_comparison_table_reads_by_hand() -> None:
    runs = {"kvserve serve": [summary(100, 300, 2.0), summary(80, 200, 1.0), summary(120, 500, 3.0)],
            "llama-server": [summary(40, 600, 1.0), summary(50, 100, 1.0), summary(100, 1000, 0.5)]}
    lines = comparison_table(runs, {"transformers": "it did not start: no bf16"})
    assert lines[2:] == [
        "| kvserve serve | 3 | 2.00 | 100.0 | 300.0 | 2.00 | 300 / 300 | 30.0 / 30.0 | 30.0 | 600 | 0 |",
        "| llama-server | 3 | 1.00 | 50.0 | 150.0 | 1.00 | 600 / 600 | 60.0 / 60.0 | 60.0 | 1200 | 0 |",
        # goodput's rounds: 2, 1, 6; TTFT p99's 0.5, 2, 0.5.
        "| kvserve serve / llama-server | | | 1.60x | 1.60x | 2.00x | p99 0.50x | p99 0.50x | 0.50x | 0.50x | |",
        "| transformers | skipped: it did not start: no bf16 | | | | | | | | | |"]


class FakeClient:
    """run_load's stand-in: each measured run of a server returns one two-token request whose
    wall time the test sets per server, round after round."""

    def __init__(self, walls: dict[str, list[float]]) -> None:
        self.walls = walls
        self.calls: list[tuple[str, int, Any]] = []

    def __call__(self, url: str, sessions: list[Any], request_rate: float = math.inf, burstiness: float = 1.0,
                 max_concurrency: int | None = None, seed: int = 0, model: str | None = None,
                 prompt_fields: Any = token_id_prompt) -> tuple[list[StreamRecord], float]:
        name = url.removeprefix("http://")
        self.calls.append((name, len(sessions), prompt_fields))
        if len(sessions) == 4:  # the warm-up: four random sessions
            return [], 1.0
        return [StreamRecord(0.0, (0.1, 0.2), 10, 2)], self.walls[name].pop(0)


def run_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, client: FakeClient, started: list[str],
              fails: dict[tuple[str, int], str] | None = None) -> str:
    """`kvserve bench serve --url http://kv --peers ...` with stand-ins for the peers, the servers'
    starts (recorded in `started`) and the client."""
    def text_fields(request: Any) -> dict[str, Any]:
        return {"prompt": "text"}

    peers = [Peer("fake-peer", lambda port: ["true"], text_fields), Skipped("llama-server", "not built here")]
    monkeypatch.setattr(serve_load, "resolve_peers", lambda args: peers)

    def start(name: str, args: Any, ready: dict[str, Peer], num_requests: int) -> SimpleNamespace:
        started.append(name)
        if (reason := (fails or {}).get((name, started.count(name)))) is not None:
            raise RuntimeError(reason)
        return SimpleNamespace(url=name if name.startswith("http") else f"http://{name}", stop=lambda: None)

    monkeypatch.setattr(serve_load, "_start", start)
    monkeypatch.setattr(serve_load, "run_load", client)
    args = build_parser().parse_args(["bench", "serve", "--url", "http://kv", "--num-requests", "3", "--rounds", "3",
                                      "--out", str(tmp_path)])
    tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens=False: [ord(c) % 256 for c in text])
    serve_load.run_serve_bench(args, SimpleNamespace(tokenizer=tokenizer), tmp_path)  # type: ignore[arg-type]
    return (tmp_path / "serve_load.md").read_text()


def test_bench_serve_alternates_the_servers_and_reports_medians(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # kvserve's output tok/s by round: 2, 1, 0.5 (median 1); the peer's 0.5, 2, 1 (median 1);
    # the rounds' ratios 4, 0.5, 0.5: median 0.5.
    client = FakeClient({"kv": [1.0, 2.0, 4.0], "fake-peer": [4.0, 1.0, 2.0]})
    started: list[str] = []
    report = run_bench(tmp_path, monkeypatch, client, started)
    assert started == ["http://kv", "fake-peer"] * 3
    assert [(name, n) for name, n, _ in client.calls] == [("kv", 4), ("kv", 3), ("fake-peer", 4), ("fake-peer", 3)] * 3
    assert all(fields is token_id_prompt for name, _, fields in client.calls if name == "kv")
    assert all(fields(None) == {"prompt": "text"} for name, _, fields in client.calls if name == "fake-peer")
    rows = {line.split(" | ")[0]: line for line in report.splitlines() if line.startswith("| ")}
    # Completed req/s: 1, 0.5, 0.25 and 0.25, 1, 0.5 (one request a run): medians 0.5.
    assert rows["| http://kv"].startswith("| http://kv | 3 | 0.50 | 1.0 |")
    assert rows["| fake-peer"].startswith("| fake-peer | 3 | 0.50 | 1.0 |")
    assert rows["| http://kv / fake-peer"].startswith("| http://kv / fake-peer | | | 0.50x |")
    assert "| llama-server | skipped: not built here |" in report
    assert "- http://kv, each round: output tok/s 2.0, 1.0, 0.5;" in report
    assert "**fake-peer at inf req/s, round 2**" in report


def test_a_peer_that_fails_to_start_is_skipped_from_then_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    client = FakeClient({"kv": [1.0, 2.0, 4.0], "fake-peer": [4.0]})
    started: list[str] = []
    report = run_bench(tmp_path, monkeypatch, client, started, fails={("fake-peer", 2): "port taken"})
    assert started == ["http://kv", "fake-peer", "http://kv", "fake-peer", "http://kv"]
    assert "| fake-peer | skipped: it did not start: port taken |" in report
    assert "| http://kv / fake-peer" not in report
