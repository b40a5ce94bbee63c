"""The background step loop, driven directly (no HTTP) on the tiny random model."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.sequence import RequestOutput, Sequence
from kvserve.server.async_engine import AsyncEngine, Done, Draining, QueueFull
from kvserve.server.metrics import Metrics


@pytest.fixture
def aengine(tiny_llm: Callable[..., LLM]) -> Iterator[Callable[..., AsyncEngine]]:
    made: list[AsyncEngine] = []

    def make(max_waiting: int = 8, **kwargs: object) -> AsyncEngine:
        a = AsyncEngine(tiny_llm(**kwargs).engine, Metrics(), max_waiting)
        a.start()
        made.append(a)
        return a

    yield make
    for a in made:
        a.shutdown(timeout=5)


async def collect(sink: asyncio.Queue, requests: int) -> list[RequestOutput]:
    outs, done = [], 0
    while done < requests:
        item = await sink.get()
        if isinstance(item, Done):
            done += 1
        else:
            outs.append(item)
    return outs


def test_outputs_equal_offline_generate(aengine: Callable[..., AsyncEngine], tiny_llm: Callable[..., LLM]) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    expected = [o.token_ids for o in tiny_llm().generate(prompts, params, use_tqdm=False)]
    a = aengine()

    async def run() -> list[list[int]]:
        ids, sink = await a.submit(prompts, params, "r")
        outs = await collect(sink, len(ids))
        return [next(o.token_ids for o in outs if o.finished and o.request_id == rid) for rid in ids]

    assert asyncio.run(run()) == expected


def test_invalid_request_raises_and_others_continue(aengine: Callable[..., AsyncEngine]) -> None:
    a = aengine()

    async def run() -> RequestOutput:
        with pytest.raises(ValueError, match="max_tokens"):
            await a.submit([[1] * 200], SamplingParams(max_tokens=100), "bad")
        ids, sink = await a.submit([[1, 2]], SamplingParams(max_tokens=4, ignore_eos=True), "good")
        return [o for o in await collect(sink, 1) if o.finished][0]

    assert len(asyncio.run(run()).token_ids) == 4


def test_queue_bound_refuses_and_abort_frees_blocks(aengine: Callable[..., AsyncEngine]) -> None:
    a = aengine(max_waiting=1, max_num_seqs=1)
    long = SamplingParams(max_tokens=200, ignore_eos=True)

    async def run() -> None:
        ids, sink = await a.submit([[1, 2, 3]], long, "running")
        await sink.get()  # it is running (and holds blocks) once it produced a token
        await a.submit([[1, 2, 3]], long, "waiting")
        with pytest.raises(QueueFull):
            await a.submit([[1, 2, 3]], long, "refused")
        a.abort(["running", "waiting"])
        while not isinstance(await sink.get(), Done):
            pass
        usage = await a.call(lambda e: e.kv_usage())
        waiting = await a.call(lambda e: len(e.scheduler.waiting) + len(e.scheduler.running))
        assert usage.used == 0 and waiting == 0

    asyncio.run(run())
    assert a.metrics.rejected.labels(reason="queue_full")._value.get() == 1


@pytest.mark.parametrize("n, burst, taken", [(1, 12, 10), (4, 5, 4)])
def test_a_burst_that_fits_the_batch_is_taken(aengine: Callable[..., AsyncEngine], n: int, burst: int,
                                              taken: int) -> None:
    """A burst that lands between two steps: the batch's free seats (8, a seat per sample) take
    what they can, and only the requests left over count against max_waiting (2). Every one
    counted before, so a burst that fits an idle batch got 429s."""
    a = aengine(max_waiting=2, max_num_seqs=8)
    params = SamplingParams(max_tokens=4, n=n, ignore_eos=True)
    gate = threading.Event()

    async def run() -> list[str]:
        # The engine thread is busy (as in a step) while the whole burst reaches its inbox.
        a.call_soon(lambda e: gate.wait())
        try:
            tasks = [asyncio.ensure_future(a.submit([[1, 2, 3]], params, f"r{i}")) for i in range(burst)]
            await asyncio.sleep(0.1)
        finally:
            gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, QueueFull) for r in results if isinstance(r, BaseException))
        accepted = [r for r in results if not isinstance(r, BaseException)]
        for ids, sink in accepted:
            assert len([o for o in await collect(sink, len(ids)) if o.finished]) == n
        return [rid for ids, _ in accepted for rid in ids]

    assert asyncio.run(run()) == [f"r{i}" for i in range(taken)]
    assert a.metrics.rejected.labels(reason="queue_full")._value.get() == burst - taken


def test_error_in_one_request_fails_only_that_request(aengine: Callable[..., AsyncEngine]) -> None:
    a = aengine()

    class Faulty(OutputProcessor):
        def append_text(self, seq: Sequence, token: int) -> None:
            if seq.request_id == "faulty" and len(seq.output_token_ids) == 3:
                raise RuntimeError("boom")
            super().append_text(seq, token)

    a.engine.update.output_processor = Faulty(a.engine.eos_token_id, a.engine.max_model_len)
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    async def run() -> dict[str, RequestOutput]:
        _, bad = await a.submit([[1, 2]], params, "faulty")
        _, good = await a.submit([[3, 4]], params, "fine")
        outs = await collect(bad, 1) + await collect(good, 1)
        return {o.request_id: o for o in outs if o.finished}

    finals = asyncio.run(run())
    assert finals["faulty"].finish_reason == "error" and "boom" in finals["faulty"].error
    assert finals["fine"].finish_reason == "length" and len(finals["fine"].token_ids) == 8


def test_shutdown_drains_then_refuses(aengine: Callable[..., AsyncEngine]) -> None:
    a = aengine()

    async def run() -> None:
        ids, sink = await a.submit([[1, 2]], SamplingParams(max_tokens=6, ignore_eos=True), "r")
        a.begin_drain()
        with pytest.raises(Draining):
            await a.submit([[1, 2]], SamplingParams(max_tokens=6), "late")
        outs = await collect(sink, 1)
        assert outs[-1].finish_reason == "length"

    asyncio.run(run())


def test_serve_start_redis_gives_a_working_server() -> None:
    import shutil

    import redis

    from kvserve.server.local_redis import start_local_redis

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (scripts/install.sh --test installs it)")
    client = redis.Redis.from_url(start_local_redis())
    assert client.ping() and client.config_get("save") == {"save": ""}
    client.shutdown(nosave=True)


def test_step_timers_split_prefill_and_decode_steps(aengine: Callable[..., AsyncEngine]) -> None:
    """Two prompts of 3 and 5 tokens admitted together, 6 tokens each: one step runs both prompts
    (8 tokens, 2 outputs), then 5 decode steps of 2 tokens; a decode step is one whose tokens
    equal its outputs. Every step's time is counted, and no other."""
    a = aengine()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    gate = threading.Event()

    async def run() -> None:
        a.call_soon(lambda e: gate.wait())  # both prompts reach the inbox before the first step
        try:
            submitted = asyncio.ensure_future(a.submit([[1, 2, 3], [4, 5, 6, 7, 8]], params, "r"))
            await asyncio.sleep(0.1)
        finally:
            gate.set()
        ids, sink = await submitted
        await collect(sink, len(ids))

    asyncio.run(run())
    m = a.metrics

    def count(kind: str) -> float:
        return m.registry.get_sample_value("kvserve_engine_step_seconds_count", {"kind": kind})

    def tokens(kind: str) -> float:
        return m.registry.get_sample_value("kvserve_engine_step_tokens_total", {"kind": kind})

    assert (count("prefill"), tokens("prefill")) == (1, 8)
    assert (count("decode"), tokens("decode")) == (5, 10)
    seconds = sum(m.registry.get_sample_value("kvserve_engine_step_seconds_sum", {"kind": k})
                  for k in ("prefill", "decode"))
    assert 0 < seconds
