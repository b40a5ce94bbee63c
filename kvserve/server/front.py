"""What the HTTP layer needs from whatever runs requests: one engine in this process
(`AsyncEngine`) or replicas behind a router (`kvserve.replicas.front.ReplicaFront`)."""
from __future__ import annotations

import asyncio
from typing import Any, Protocol

from kvserve.sampling_params import SamplingParams


class EngineFront(Protocol):
    tokenizer: Any           # a Hugging Face tokenizer, or None for a random-weight model
    model_name: str
    max_model_len: int

    @property
    def draining(self) -> bool: ...

    async def submit(self, prompts: list[list[int]], params: SamplingParams, request_id: str,
                     cache_salt: str | None = None) -> tuple[list[str], asyncio.Queue]:
        """Queues one request per prompt, all or none; their RequestOutputs, then one `Done` per
        request (an exception before it for a request that failed), arrive on the queue.
        Raises ValueError (bad input), QueueFull or Draining."""

    def abort(self, request_ids: list[str]) -> None: ...

    async def metrics_text(self) -> bytes:
        """Prometheus exposition text."""

    async def kv_state(self, expose_request_ids: bool, replica: str | None = None) -> dict[str, Any]:
        """The dashboard's picture of a KV pool; with replicas, `replica`'s (default the first),
        with "replica" and the ids of all in "replicas". ValueError ("replica: ...") when
        `replica` names none of them."""
