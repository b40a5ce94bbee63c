"""The engine's step loop on a background thread, fed by the HTTP handlers.

Only this thread touches the engine. Handlers send it work (`call`, `submit`, `abort`) through an
inbox that it drains between steps, and each request's outputs come back on an asyncio queue of
the handler's event loop. A slow client therefore only lets its own queue grow; the batch keeps
stepping.

The waiting queue is bounded: a request that would leave more than `max_waiting` requests
waiting for a batch seat, counted by the scheduler's own admission rule
(`Scheduler.waiting_past_seats`), is refused (`QueueFull`, a 429), so a burst that fits the batch
is taken whole.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.sequence import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.kv_state import kv_state
from kvserve.server.metrics import Metrics
from kvserve.validate import FieldError

logger = logging.getLogger(__name__)
T = TypeVar("T")


class QueueFull(Exception):
    """The waiting queue is at its bound; the client should retry later."""


class Draining(Exception):
    """The server is shutting down and admits nothing new."""


@dataclass(frozen=True)
class Done:
    """Posted once a request has left the engine (finished, aborted or failed)."""
    request_id: str


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for sink, item in items:
        sink.put_nowait(item)


def _send(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, Any]]) -> None:
    """Hands items to queues of `loop` in one wake-up."""
    try:
        loop.call_soon_threadsafe(_deliver, items)
    except RuntimeError:  # that event loop has closed: nobody is listening any more
        pass


def request_ids(request_id: str, num_prompts: int) -> list[str]:
    """The engine request of each prompt of one HTTP request."""
    return [request_id] if num_prompts == 1 else [f"{request_id}-{i}" for i in range(num_prompts)]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: Metrics, max_waiting: int,
                 on_fatal: Callable[[], None] | None = None) -> None:
        """`on_fatal`: called (on the engine thread) once the engine can run no further step,
        after every request was failed; the server stops on it and exits non-zero."""
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self._on_fatal = on_fatal
        self.fatal: str | None = None  # why the engine stopped for good
        self._inbox: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Future | None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._draining = False
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvserve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- what the HTTP layer reads (server/front.py) ----------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def metrics_text(self) -> bytes:
        await self.call(self.metrics.observe_gauges)
        return self.metrics.render()

    async def kv_state(self, expose_request_ids: bool, replica: str | None = None) -> dict[str, Any]:
        """One engine: there is no `replica` to name."""
        if replica is not None:
            raise FieldError("replica", "replica: this server runs one engine, not replicas (kvserve serve --replicas)")
        return await self.call(lambda e: kv_state(e, expose_request_ids))

    # -- called from the event loop ------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs `fn(engine)` on the engine thread between two steps and returns its result."""
        future: Future = Future()
        self._inbox.put((fn, future))
        self._wake.set()
        return await asyncio.wrap_future(future)

    def call_soon(self, fn: Callable[[LLMEngine], Any]) -> None:
        self._inbox.put((fn, None))
        self._wake.set()

    async def submit(self, prompts: list[list[int]], params: SamplingParams, request_id: str,
                     cache_salt: str | None = None) -> tuple[list[str], asyncio.Queue]:
        """Queues one engine request per prompt, all or none. Their outputs, then one `Done` per
        request, arrive on the returned queue. Raises ValueError, QueueFull or Draining."""
        sink: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        ids = request_ids(request_id, len(prompts))
        # Not even an idle server could take them all (a prompt takes a batch seat per sample or
        # beam): not a matter of retrying. Checked here, before the engine thread validates each.
        max_num_seqs = self.engine.scheduler.max_num_seqs
        most = max_num_seqs // max(params.n, params.beam_width) + self.max_waiting
        if len(prompts) > most:
            self.metrics.rejected.labels(reason="invalid").inc()
            raise FieldError("prompt", f"prompt: {len(prompts)} prompts in one request exceed what the server takes at "
                             f"once: {most} (a batch of max_num_seqs={max_num_seqs} sequences, then "
                             f"--max-waiting {self.max_waiting}); send at most {most}")

        def add(engine: LLMEngine) -> list[str]:
            if self._draining:
                raise Draining("the server is shutting down")
            seqs = [engine.make_sequence(p, params, rid, cache_salt) for p, rid in zip(prompts, ids)]
            # The bound is on requests waiting for a batch seat: those that the next step admits
            # into free seats do not wait, so a burst that fits the batch is taken whole.
            waiting = engine.scheduler.waiting_past_seats(seqs)
            if waiting > self.max_waiting:
                self.metrics.rejected.labels(reason="queue_full").inc()
                raise QueueFull(f"with this request {waiting} would wait for a batch seat "
                                f"(max_waiting={self.max_waiting})")
            for seq in seqs:
                engine.add_sequence(seq)
                self._sinks[seq.request_id] = (loop, sink)
                self.metrics.prompt_tokens.inc(len(seq.prompt_token_ids))
            return ids

        try:
            return await self.call(add), sink
        except ValueError:
            self.metrics.rejected.labels(reason="invalid").inc()
            raise

    def abort(self, request_ids: list[str]) -> None:
        """For a client gone mid-request: its blocks are freed before the next step runs."""
        def abort(engine: LLMEngine) -> None:
            for rid in request_ids:
                if engine.is_active(rid):
                    self._end(rid, "abort")
        self.call_soon(abort)

    def begin_drain(self) -> None:
        """Stop admitting; running and queued requests go on."""
        self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    def wait_idle(self, timeout: float) -> bool:
        """Blocks (off the event loop) until no request is queued or running, or `timeout`
        seconds pass; returns whether it went idle."""
        deadline = time.monotonic() + timeout
        while self._thread.is_alive():
            idle: Future = Future()
            self._inbox.put((lambda e: not e.has_unfinished(), idle))
            self._wake.set()
            if idle.result():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def abort_all(self, message: str) -> None:
        """Ends every request with an error its handler reports (a stream: an error event, then
        [DONE]); for a shutdown that cannot wait any longer."""
        def abort(engine: LLMEngine) -> None:
            for rid in list(self._sinks):
                self._end(rid, "abort", Draining(message))
        self.call_soon(abort)

    def shutdown(self, timeout: float) -> None:
        """Stop admitting, let running requests finish for up to `timeout` seconds, abort the
        rest, and stop the thread."""
        self._draining = True
        self.wait_idle(timeout)
        self._stop = True
        self._wake.set()
        self._thread.join()

    # -- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while not self._stop:
            self._run_inbox()
            if not engine.has_unfinished():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            started = time.perf_counter()
            try:
                outputs = engine.step()
            except Exception:
                fatal = engine.fatal_error()
                if fatal is not None:  # no later step can run: end everything and stop
                    logger.error("kvserve: %s; failing every request and stopping", fatal)
                    self.fatal = fatal
                    self._draining = True
                    for rid in list(self._sinks):
                        self._end(rid, "error", RuntimeError(fatal))
                    if self._on_fatal is not None:
                        self._on_fatal()
                    break
                # The forward pass of the whole batch failed: no single request is to blame.
                logger.exception("engine step failed; aborting the batch")
                self._fail_running("internal error in the engine step")
                continue
            self._dispatch(outputs, time.perf_counter() - started)
        self._run_inbox()
        for rid in list(self._sinks):
            self._end(rid, "abort")

    def _run_inbox(self) -> None:
        while True:
            try:
                fn, future = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn(self.engine)
            except Exception as err:
                if future is None:
                    logger.exception("engine task failed")
                else:
                    future.set_exception(err)
            else:
                if future is not None:
                    future.set_result(result)

    def _dispatch(self, outputs: list[RequestOutput], seconds: float) -> None:
        # One wake-up of each event loop per step, however many outputs it gets.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for out in outputs:
            if (target := self._sinks.get(out.request_id)) is not None:
                batches.setdefault(target[0], []).append((target[1], out))
            if out.finished:
                self.metrics.observe_finished(out)
        self.metrics.observe_step_cost(self.engine, seconds, len(outputs))
        self.metrics.observe_step(self.engine)
        # After every output of the step: the samples of one request may finish together.
        for rid in {o.request_id for o in outputs if o.finished}:
            if not self.engine.is_active(rid) and (target := self._sinks.pop(rid, None)) is not None:
                batches.setdefault(target[0], []).append((target[1], Done(rid)))
        for loop, items in batches.items():
            _send(loop, items)

    def _fail_running(self, message: str) -> None:
        for rid in {s.request_id for s in self.engine.scheduler.running}:
            self._end(rid, "error", RuntimeError(message))

    def _end(self, request_id: str, reason: str, error: Exception | None = None) -> None:
        """Ends a request the engine still holds, counts it, and tells its handler."""
        self.engine.abort(request_id)
        self.metrics.finished.labels(finish_reason=reason).inc()
        if (target := self._sinks.pop(request_id, None)) is not None:
            loop, sink = target
            _send(loop, ([(sink, error)] if error is not None else []) + [(sink, Done(request_id))])
