"""Tokens sampled on the device whose host copy is still on its way (async scheduling).

With async scheduling the engine launches step N + 1 before it reads step N's tokens, so the
host's bookkeeping of step N (detokenizing, stop checks, outputs) and the scheduling of step
N + 2 run while the device computes (vLLM v1's async scheduling, SGLang's overlap scheduler).
Until its token is read, each sampled sequence ends in `PLACEHOLDER`; the next step takes the
token from the device by its row here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.sequence import Sequence


@dataclass(frozen=True)
class PendingTokens:
    seqs: list[Sequence]
    rows: dict[str, int]        # seq_id -> its row of `device`
    device: torch.Tensor        # [len(seqs)] sampled tokens, where the model ran
    host: torch.Tensor          # the same on the host, filled by a copy queued after the sampling
    copied: torch.cuda.Event | None  # recorded after that copy (None: the model runs on the host)

    @classmethod
    def launch(cls, seqs: list[Sequence], tokens: torch.Tensor) -> PendingTokens:
        """Queues the copy of `tokens` to the host without waiting for it."""
        rows = {s.seq_id: i for i, s in enumerate(seqs)}
        if tokens.device.type != "cuda":
            return cls(seqs, rows, tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(tokens.device))  # the copy's stream, on cuda:N too
        return cls(seqs, rows, tokens, host, copied)

    def read(self) -> list[int]:
        """The tokens, once their copy has landed (the steps queued since keep the device busy)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()
