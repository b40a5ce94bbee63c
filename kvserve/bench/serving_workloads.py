"""The serving benchmark's workloads (`kvserve bench serve --workload`), each a list of sessions: a
session's requests are sent one after another (a chat's turns), sessions at the send schedule.
Every token comes from slices of a text's ids (bench/workload.py), drawn by a seeded generator,
so a run is repeated exactly.

- `random`: one request per session, lognormal prompt and output lengths (`make_workload`);
- `shared-prefix`: SGLang's generated-shared-prefix shape: `groups` system prompts of
  `system_len` tokens, each followed by `questions` different questions of `question_len` tokens;
  sessions interleave the groups, so a group's prompt must stay cached while others run;
- `multi-turn`: `users` chats of `turns` turns; turn k's prompt is the whole conversation so far
  (every earlier message and a recorded answer of `answer_len` tokens to it, as a chat dataset
  replays them) and its new message of `message_len` tokens: the prefix of turn k is turn k-1's
  prompt, the case prefix caching pays most for;
- `long-context`: `docs` documents of `doc_len` tokens, each asked `questions` short questions.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvserve.bench.workload import WorkloadRequest, make_workload

WORKLOADS = ("random", "shared-prefix", "multi-turn", "long-context")
Session = list[WorkloadRequest]


@dataclass(frozen=True)
class Shape:
    """A workload's numbers (defaults sized for a 2-core CPU; the report prints them)."""
    groups: int = 8            # shared-prefix
    questions: int = 8         # shared-prefix, long-context: per system prompt / document
    system_len: int = 1024
    question_len: int = 64
    users: int = 8             # multi-turn
    turns: int = 4
    message_len: int = 64
    answer_len: int = 128
    docs: int = 2              # long-context
    doc_len: int = 7680        # with a question and the output, within an 8k context
    output_len: int = 128


class _Slicer:
    """Slices of `ids` at seeded random offsets."""

    def __init__(self, ids: list[int], seed: int) -> None:
        self.ids, self.rng = ids, np.random.default_rng(seed)

    def take(self, n: int) -> list[int]:
        if n > len(self.ids):
            raise ValueError(f"--data: the text has {len(self.ids)} tokens, a workload piece needs {n}")
        start = int(self.rng.integers(0, len(self.ids) - n + 1))
        return list(self.ids[start:start + n])


def make_sessions(kind: str, ids: list[int], seed: int, shape: Shape, num_requests: int = 200,
                  prompt_len_median: int = 128, output_len_median: int = 64) -> list[Session]:
    """The sessions of workload `kind`; `num_requests` and the medians are `random`'s."""
    take = _Slicer(ids, seed).take
    s = shape
    if kind == "random":
        return [[r] for r in make_workload(ids, num_requests, seed, prompt_len_median, output_len_median)]
    if kind == "shared-prefix":
        systems = [take(s.system_len) for _ in range(s.groups)]
        return [[WorkloadRequest(systems[g] + take(s.question_len), s.output_len)]
                for _ in range(s.questions) for g in range(s.groups)]
    if kind == "multi-turn":
        sessions = []
        for _ in range(s.users):
            so_far: list[int] = []
            turns = []
            for _ in range(s.turns):
                prompt = so_far + take(s.message_len)
                turns.append(WorkloadRequest(prompt, s.output_len))
                so_far = prompt + take(s.answer_len)
            sessions.append(turns)
        return sessions
    if kind == "long-context":
        docs = [take(s.doc_len) for _ in range(s.docs)]
        return [[WorkloadRequest(docs[d] + take(s.question_len), s.output_len)]
                for _ in range(s.questions) for d in range(s.docs)]
    raise ValueError(f"--workload: {kind!r} is not one of {', '.join(WORKLOADS)}")
