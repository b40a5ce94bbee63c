"""The engine's step timers as `kvserve bench serve` reads them from /metrics."""
from __future__ import annotations

from types import SimpleNamespace
from typing import cast

from kvserve.bench.serve_steps import parse_step_totals, steps_line
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.metrics import Metrics


def test_totals_read_back_from_the_metrics_text() -> None:
    metrics = Metrics()
    engine = SimpleNamespace(tokens_computed=0)

    def step(tokens: int, outputs: int, seconds: float) -> None:
        engine.tokens_computed += tokens
        metrics.observe_step_cost(cast(LLMEngine, engine), seconds, outputs)

    step(300, 3, 0.25)  # prompt chunks beside two decodes
    step(8, 8, 0.03)
    step(8, 8, 0.05)
    totals = parse_step_totals(metrics.render().decode())
    assert totals.steps == {"decode": 2, "prefill": 1}
    assert totals.tokens == {"decode": 16, "prefill": 300}
    assert abs(totals.seconds["decode"] - 0.08) < 1e-9 and abs(totals.seconds["prefill"] - 0.25) < 1e-9


def test_steps_line_is_the_run_between_two_readings() -> None:
    text = """
kvserve_engine_step_seconds_count{kind="decode"} 10.0
kvserve_engine_step_seconds_sum{kind="decode"} 0.5
kvserve_engine_step_tokens_total{kind="decode"} 80.0
kvserve_engine_step_seconds_count{kind="prefill"} 1.0
kvserve_engine_step_seconds_sum{kind="prefill"} 0.2
kvserve_engine_step_tokens_total{kind="prefill"} 100.0
"""
    later = text.replace("} 10.0", "} 110.0").replace("} 0.5", "} 3.5").replace("} 80.0", "} 880.0") \
        .replace('prefill"} 1.0', 'prefill"} 5.0').replace("} 0.2", "} 1.2").replace("} 100.0", "} 1300.0")
    line = steps_line(parse_step_totals(text), parse_step_totals(later), 4.0)
    # 100 decode steps of 3 s, 4 prefill steps of 1 s: 104 steps in 4 s, 100% of it in steps.
    assert line == ("engine steps: 104 (26.0/s), in steps 100% of the run's wall; decode 100 steps, 75% of wall, "
                    "30.0 ms and 8.0 tokens a step; prefill 4 steps, 25% of wall, 250.0 ms and 300.0 tokens a step")
