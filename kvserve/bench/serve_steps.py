"""Where a `kvserve serve` run's wall time went, by the engine's own step timers: its
`kvserve_engine_step_seconds` and `kvserve_engine_step_tokens` metrics read before and after a
run. The client sees latencies; this says whether the engine thread was busy the whole run (the
server's HTTP path and the client then cost it nothing) and what its steps cost: decode steps
(one token per sequence: the weights' read and attention) against steps that ran prompt chunks.
"""
from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvserve.server.metrics import STEP_KINDS


@dataclass(frozen=True)
class StepTotals:
    """Running totals per step kind: steps, their seconds, their tokens."""
    steps: dict[str, float]
    seconds: dict[str, float]
    tokens: dict[str, float]


def parse_step_totals(text: str) -> StepTotals:
    steps = dict.fromkeys(STEP_KINDS, 0.0)
    seconds, tokens = dict(steps), dict(steps)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            kind = sample.labels.get("kind")
            if kind not in steps:
                continue
            if sample.name == "kvserve_engine_step_seconds_count":
                steps[kind] = sample.value
            elif sample.name == "kvserve_engine_step_seconds_sum":
                seconds[kind] = sample.value
            elif sample.name == "kvserve_engine_step_tokens_total":
                tokens[kind] = sample.value
    return StepTotals(steps, seconds, tokens)


def read_step_totals(url: str) -> StepTotals:
    return parse_step_totals(httpx.get(f"{url}/metrics", timeout=30).text)


def steps_line(before: StepTotals, after: StepTotals, wall_s: float) -> str:
    """The run between the two readings, `wall_s` long, as one line of the report."""
    def delta(field: str, kind: str) -> float:
        return getattr(after, field)[kind] - getattr(before, field)[kind]

    busy = sum(delta("seconds", k) for k in STEP_KINDS)
    steps = sum(delta("steps", k) for k in STEP_KINDS)
    parts = [f"engine steps: {steps:.0f} ({steps / wall_s:.1f}/s), in steps {busy / wall_s:.0%} of the run's wall"]
    for kind in STEP_KINDS:
        n = delta("steps", kind)
        if n:
            parts.append(f"{kind} {n:.0f} steps, {delta('seconds', kind) / wall_s:.0%} of wall, "
                         f"{1000 * delta('seconds', kind) / n:.1f} ms and {delta('tokens', kind) / n:.1f} tokens a step")
    return "; ".join(parts)
