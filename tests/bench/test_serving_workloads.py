"""The serving workloads' shapes, worked from their parameters, and one whole `kvserve bench serve`."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.bench.serving_workloads import Shape, make_sessions
from kvserve.cli import main

IDS = list(range(100_000))  # distinct ids: a shared slice can only come from the same draw
SHAPE = Shape(groups=3, questions=4, system_len=50, question_len=7, users=2, turns=3, message_len=5, answer_len=9,
              docs=2, doc_len=300, output_len=11)


def test_shared_prefix_interleaves_groups_that_share_their_system_prompt() -> None:
    sessions = make_sessions("shared-prefix", IDS, 0, SHAPE)
    assert len(sessions) == 12 and all(len(s) == 1 for s in sessions)
    requests = [s[0] for s in sessions]
    assert all(len(r.prompt_token_ids) == 57 and r.max_tokens == 11 for r in requests)
    systems = [tuple(r.prompt_token_ids[:50]) for r in requests]
    assert systems[:3] == systems[3:6] == systems[9:12] and len(set(systems)) == 3  # group i % 3
    assert len({tuple(r.prompt_token_ids[50:]) for r in requests}) == 12  # every question its own


def test_each_chat_turn_extends_the_conversation_before_it() -> None:
    sessions = make_sessions("multi-turn", IDS, 0, SHAPE)
    assert len(sessions) == 2 and all(len(s) == 3 for s in sessions)
    for turns in sessions:
        # Turn k: k earlier messages and answers (5 + 9 tokens each) and its own message of 5.
        assert [len(t.prompt_token_ids) for t in turns] == [5, 19, 33]
        for before, after in zip(turns, turns[1:]):
            assert after.prompt_token_ids[:len(before.prompt_token_ids)] == before.prompt_token_ids
    assert sessions[0][0].prompt_token_ids != sessions[1][0].prompt_token_ids


def test_long_context_asks_each_document_several_questions() -> None:
    requests = [s[0] for s in make_sessions("long-context", IDS, 0, SHAPE)]
    assert len(requests) == 8 and all(len(r.prompt_token_ids) == 307 for r in requests)
    assert len({tuple(r.prompt_token_ids[:300]) for r in requests}) == 2


@pytest.mark.parametrize("kind", ["random", "shared-prefix", "multi-turn", "long-context"])
def test_a_workload_is_seeded(kind: str) -> None:
    one, again, other = (make_sessions(kind, IDS, seed, SHAPE, num_requests=5) for seed in (1, 1, 2))
    assert one == again and one != other


def test_a_text_too_short_for_a_piece_names_the_option() -> None:
    with pytest.raises(ValueError, match="--data: the text has 100 tokens, a workload piece needs 300"):
        make_sessions("long-context", IDS[:100], 0, SHAPE)


def test_bench_serve_runs_a_workload_against_a_real_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["bench", "serve", "--num-requests", "4", "--prompt-len-median", "16", "--output-len-median", "4",
          "--max-concurrency", "2", "--request-rate", "20", "--goodput", "ttft:60000", "--kv-cache-memory", "64MiB",
          "--max-model-len", "256", "--out", str(tmp_path)])
    report = (tmp_path / "serve_load.md").read_text()
    assert "workload random: 4 sessions, 4 streaming completions" in report
    assert "4 completed, 0 failed" in report and "| TTFT |" in report and "| ITL |" in report
    assert "KV blocks in use afterwards: 0" in report and "goodput" in report
