"""Shared fixtures: tiny random-weight engines for speed, the real model for parity."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

# Without a GPU the Triton backend's kernels run in Triton's interpreter (CPU tensors, numpy):
# slow, so tests keep them to small shapes, and "auto" never picks it on the CPU. Set before
# anything imports triton, which reads it when a kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Parallel workers (pytest -n): one thread each, in the processes their tests start too, or
    # OpenMP threads spinning at their barriers would fight the other workers for the cores.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    from triton.runtime import interpreter
    # Compiled for a GPU, Triton checks integer overflow only in debug mode; its interpreter
    # checks every integer add and multiply by default, ~40% of the interpreted tests' time.
    interpreter.interpreter_builder.options = dataclasses.replace(interpreter.interpreter_builder.options,
                                                                  sanitize_overflow=False)

from kvserve import LLM, LLMEngine  # noqa: E402
from kvserve.engine.idle_check import idle_problems  # noqa: E402
from kvserve.model.config import ModelConfig  # noqa: E402
from kvserve.net import free_loopback_port  # noqa: E402

# Weights ten times HF's initializer range: at 0.02 attention is nearly uniform and greedy decoding
# repeats one token, so outputs barely depend on the cache and a KV bug could pass every test.
TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position=512, initializer_range=0.2)
# HF's range: for comparing two numerical paths in reduced precision, where the sharp model turns
# rounding differences into different quantization codes and a test would measure only that noise.
CALM = dataclasses.replace(TINY, initializer_range=0.02)


# Every engine a test builds, so that the idle invariant is checked after the test (below).
_built_this_test: list[LLMEngine] = []
_built: weakref.WeakSet[LLMEngine] = weakref.WeakSet()  # the session's fixtures' engines too
_engine_init = LLMEngine.__init__


def _tracked_init(self: LLMEngine, *args: Any, **kwargs: Any) -> None:
    _engine_init(self, *args, **kwargs)
    _built_this_test.append(self)
    _built.add(self)


LLMEngine.__init__ = _tracked_init  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def idle_engines_hold_nothing() -> Iterator[None]:
    """After every test: each engine it (or an earlier fixture) built that has no request left
    holds nothing of any request (kvserve.engine.idle_check): a leak fails the test that made it."""
    yield
    engines = {id(e): e for e in [*_built_this_test, *_built]}.values()
    _built_this_test.clear()
    leaks = [f"{e.model_name}: {'; '.join(problems)}" for e in engines
             if not e.has_unfinished() and (problems := idle_problems(e))]
    if leaks:
        pytest.fail("an idle engine still holds request state: " + " | ".join(leaks))


def assert_all_blocks_free(llm: LLM) -> None:
    usage = llm.engine.kv_usage()
    assert usage.used == 0 and usage.free + usage.cached == usage.total, usage
    bm = llm.engine.block_manager
    assert not bm.tables and all(b.ref_count == 0 for b in bm.blocks)


# Forced preemption (vLLM's num_gpu_blocks_override habit): the tests of a module marked
# `forced_preemption` run twice, the second time with every engine `tiny_llm` builds without a
# pool size of its own given one sequence's blocks and one more, so that the tests that generate
# run through preemption under every feature. A test whose assertions need room (prefix-cache
# counts, a beam group's blocks at once) is marked `roomy` and runs once.
@pytest.fixture
def pool_kind() -> str:
    return "sized"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    node = metafunc.definition
    if "pool_kind" in metafunc.fixturenames and node.get_closest_marker("forced_preemption") \
            and not node.get_closest_marker("roomy"):
        metafunc.parametrize("pool_kind", ["sized", "tight"])


@pytest.fixture
def tiny_llm(pool_kind: str) -> Iterator[Callable[..., LLM]]:
    """Builds engines on the same random tiny model; checks each leaked no block."""
    made: list[LLM] = []

    def make(**kwargs: Any) -> LLM:
        sized = "kv_cache_memory" in kwargs or "num_blocks_override" in kwargs
        kwargs = {"model": TINY, "dtype": "float32", "device": "cpu", "kv_cache_memory": "4MiB",
                  "max_model_len": 256, **kwargs}
        if "kv_remote" in kwargs:  # at load average 8 a Redis reply took over the 0.25 s default, and
            kwargs.setdefault("kv_remote_timeout", 5.0)  # the tier then skipped the stores a test counts
        if pool_kind == "tight" and not sized:
            kwargs["num_blocks_override"] = -(-kwargs["max_model_len"] // kwargs.get("block_size", 16)) + 1
        llm = LLM(**kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert_all_blocks_free(llm)


@pytest.fixture(scope="session")
def smol() -> Iterator[LLM]:
    """The bundled SmolLM2-135M-Instruct in fp32, for exact comparison with HF transformers."""
    llm = LLM(dtype="float32", device="cpu", kv_cache_memory="512MiB", max_model_len=2048)
    yield llm
    assert_all_blocks_free(llm)


@pytest.fixture(scope="session")
def hf_smol() -> Any:
    from kvserve.bench.hf_baseline import load_hf_model
    from kvserve.model.loader import default_model_path
    model, _ = load_hf_model(str(default_model_path()), torch.float32)
    return model


_SLOW_DESELECTED = pytest.StashKey[int]()


def pytest_deselected(items: list[pytest.Item]) -> None:
    if items:
        config = items[0].config
        config.stash[_SLOW_DESELECTED] = config.stash.get(_SLOW_DESELECTED, 0) + sum(
            item.get_closest_marker("slow") is not None for item in items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    # Under xdist the workers collect and deselect: each tells the controller its count.
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["slow_deselected"] = session.config.stash.get(_SLOW_DESELECTED, 0)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    config = node.config
    count = getattr(node, "workeroutput", {}).get("slow_deselected", 0)
    config.stash[_SLOW_DESELECTED] = max(config.stash.get(_SLOW_DESELECTED, 0), count)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if slow := config.stash.get(_SLOW_DESELECTED, 0):
        terminalreporter.write_line(f"{slow} tests marked slow were deselected, as in CI (benchmark-sized runs): "
                                    f"run them with `python3 -m pytest -m slow`")


class RedisServer:
    """A real redis-server on a free loopback port, no persistence; `stop` kills it (a fault),
    `start` brings it back, empty, on the same port."""

    def __init__(self) -> None:
        import shutil

        import redis

        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.skip("redis-server is not installed (scripts/install.sh --test installs it)")
        self.port = free_loopback_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.client = redis.Redis.from_url(self.url)
        self.start()

    def start(self) -> None:
        import subprocess
        import time

        import redis

        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--enable-debug-command", "local"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                self.client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.stop()
