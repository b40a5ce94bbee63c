"""The kernels' own thread pool (kernels/csrc/thread_pool.h) and the process's thread settings
(kvserve/threads.py); the fp32 linear whose rows never depend on their batch."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kvserve.kernels import cpu_extension
from kvserve.model.cpu_linear import ROW_BUCKET, SMALL_BATCH, interleave_f32
from kvserve.threads import GOMP_SPINCOUNT, cgroup_quota, usable_cores
from tests.torch_threads import torch_threads

kernels = cpu_extension.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C++ compiler: CPU kernels not built")


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def parallel_pool() -> None:
    """Each test starts with the pool on every thread: on a busy machine an earlier test's regions
    may have sent it solo (thread_pool.cpp), and these count its parallel regions."""
    kernels.thread_pool_end_solo()


def test_a_region_runs_every_chunk_once_on_the_pool() -> None:
    """Split over the caller and a worker, every output column is written once (the result equals
    one thread's), and the pool counts the region and its chunks."""
    x, w = rand(3, 256, seed=1), interleave_f32(rand(1024, 256, seed=2))
    with torch_threads(1):
        want = kernels.linear_f32(x, w, None)
    before = kernels.thread_pool_stats()
    with torch_threads(2):
        got = kernels.linear_f32(x, w, None)
    after = kernels.thread_pool_stats()
    assert torch.equal(got, want)
    assert after["parallel_regions"] == before["parallel_regions"] + 1
    # 32 tiles of 2 groups (AVX-512) or 64 of 1 over 2 threads x 2 chunks each: 4 chunks.
    ran = sum(after[k] - before[k] for k in ("caller_chunks", "worker_chunks"))
    assert ran == 4


@pytest.mark.parametrize("dtype,rows", [(torch.bfloat16, SMALL_BATCH + 1), (torch.bfloat16, SMALL_BATCH),
                                        (torch.float32, 64), (torch.float16, 64), (torch.float16, SMALL_BATCH)])
def test_only_a_step_of_packed_onednn_linears_runs_its_regions_on_torchs_threads(dtype: torch.dtype,
                                                                                rows: int) -> None:
    """A step whose linears run as packed oneDNN matmuls on torch's threads (fp16 over SMALL_BATCH
    rows) runs its other regions there too (one team per step); every other step, bf16 prefills
    included (linear_rows), on the pool. Either way one thread's result."""
    x, w = rand(rows, 256, seed=11).to(dtype), rand(256, seed=12).to(dtype)
    with torch_threads(1):
        want = kernels.rms_norm(x, w, 1e-6, None)
    packed = dtype == torch.float16 or (dtype == torch.bfloat16 and not kernels.has_bf16_gemm())
    on_torch = packed and rows > SMALL_BATCH
    before = kernels.thread_pool_stats()
    with torch_threads(2):
        got = kernels.rms_norm(x, w, 1e-6, None)
    after = kernels.thread_pool_stats()
    assert torch.equal(got, want)
    assert after["torch_regions"] - before["torch_regions"] == int(on_torch)
    assert after["parallel_regions"] - before["parallel_regions"] == int(not on_torch)


@pytest.mark.parametrize("rows", [SMALL_BATCH + 1, 100, 130])  # 100, 130: 64-row bulk and a remainder
@pytest.mark.parametrize("bias", [False, True])
def test_linear_rows_gives_f_linears_rows_as_one_region_of_the_pool(rows: int, bias: bool) -> None:
    """A prefill's bf16 linear in column chunks on the pool, each one oneDNN call on one thread: every
    output column written (100 columns, not a multiple of the chunks' 16), F.linear's values, inside
    inference mode as the engine calls it (the pool's threads take the caller's mode), and no
    region of torch's."""
    x, w = rand(rows, 64, seed=21).bfloat16(), rand(100, 64, seed=22).bfloat16()
    b = rand(100, seed=23).bfloat16() if bias else None
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    before = kernels.thread_pool_stats()
    with torch_threads(2), torch.inference_mode():
        got = kernels.linear_rows(x, w, b, ROW_BUCKET)
    after = kernels.thread_pool_stats()
    assert got.shape == (rows, 100)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=2e-2)
    assert after["parallel_regions"] - before["parallel_regions"] == 1
    assert after["torch_regions"] == before["torch_regions"]


def test_linear_rows_refuses_a_row_bucket_below_one() -> None:
    x, w = rand(40, 64, seed=24).bfloat16(), rand(32, 64, seed=25).bfloat16()
    with pytest.raises(RuntimeError, match="row_bucket must be positive, got 0"):
        kernels.linear_rows(x, w, None, 0)


def test_linear_rows_lets_other_python_threads_run() -> None:
    """linear_rows replaced F.linear, which releases the GIL: a prefill's matmul must not stall the
    server's other Python threads (its event loop) for the whole call. Another thread keeps ticking
    while one long call runs (holding the GIL, it ticked at most once or twice)."""
    x, w = rand(1024, 2048, seed=31).bfloat16(), rand(8192, 2048, seed=32).bfloat16()
    inside, done, ticks = threading.Event(), threading.Event(), []

    def tick() -> None:
        inside.wait()
        while not done.is_set():
            time.sleep(0.001)
            ticks.append(done.is_set())

    ticker = threading.Thread(target=tick)
    ticker.start()
    with torch_threads(1), torch.inference_mode():
        inside.set()
        kernels.linear_rows(x, w, None, ROW_BUCKET)
        done.set()
    ticker.join()
    assert ticks.count(False) >= 10


def test_an_idle_worker_sleeps_and_is_counted() -> None:
    """A region wakes the worker (or finds it spinning); with no region after it the worker spins
    about 1 ms and sleeps, and the pool counts that sleep (polled: on a busy machine the worker may
    wake late)."""
    x, w = rand(3, 256, seed=1), interleave_f32(rand(1024, 256, seed=2))
    with torch_threads(2):
        before = kernels.thread_pool_stats()
        got = kernels.linear_f32(x, w, None)
        deadline = time.monotonic() + 5
        while kernels.thread_pool_stats()["worker_sleeps"] == before["worker_sleeps"]:
            assert time.monotonic() < deadline, "the worker never slept after the region"
            time.sleep(0.01)
    after = kernels.thread_pool_stats()
    assert after["worker_sleeps"] > before["worker_sleeps"] and after["caller_sleeps"] >= before["caller_sleeps"]
    assert sum(after[k] - before[k] for k in ("caller_chunks", "worker_chunks")) == 4
    with torch_threads(1):
        assert torch.equal(got, kernels.linear_f32(x, w, None))


def test_a_chunks_error_reaches_the_caller() -> None:
    """A kernel that fails inside its parallel region (encode_write checks each row's kind) raises
    in Python after every chunk has ended, and the pool goes on working."""
    x, slots = rand(64, 2, 16, seed=3), torch.arange(64)
    codes, scales = torch.zeros(64 * 2 * 16, dtype=torch.int8), torch.zeros(64 * 2, dtype=torch.half)
    before = kernels.thread_pool_stats()["parallel_regions"]
    with torch_threads(2):
        with pytest.raises(RuntimeError, match="unknown kind 7"):
            kernels.encode_write(x, slots, 7, codes, scales, scales, 16)
        assert kernels.thread_pool_stats()["parallel_regions"] == before + 1
        x, w = rand(2, 64, seed=3), interleave_f32(rand(64, 64, seed=4))
        assert torch.equal(kernels.linear_f32(x, w, None), kernels.linear_f32(x, w, None))


def test_a_forked_child_runs_kernels_on_its_own_pool() -> None:
    """fork() copies one thread: the child must not wait for its parent's workers."""
    x, w = rand(4, 256, seed=5), interleave_f32(rand(2048, 256, seed=6))
    with torch_threads(2):
        want = kernels.linear_f32(x, w, None)  # the parent's workers exist now
        pid = os.fork()
        if pid == 0:  # the child: exit status says whether it got the same result
            ok = torch.equal(kernels.linear_f32(x, w, None), want)
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


STARVED = """
import json, os, subprocess, sys, time
cpu = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpu})  # before torch: the pool's worker inherits it
hog = subprocess.Popen([sys.executable, "-c", f"import os\\nos.sched_setaffinity(0, {{{cpu}}})\\nwhile True: pass"])
try:
    import torch
    from kvserve.kernels import cpu_extension
    from kvserve.model.cpu_linear import interleave_f32
    k = cpu_extension.load()
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 256, generator=g), interleave_f32(torch.randn(1024, 256, generator=g))
    torch.set_num_threads(1)
    want = k.linear_f32(x, w, None)
    torch.set_num_threads(2)
    same, end = True, time.monotonic() + 2
    while time.monotonic() < end:
        same &= torch.equal(k.linear_f32(x, w, None), want)
    print(json.dumps({**k.thread_pool_stats(), "same": same}))
finally:
    hog.kill()
"""


def test_a_pool_starved_of_cores_runs_its_regions_on_the_caller_alone() -> None:
    """The caller, its worker and a busy loop of another process on one core: the worker runs few
    chunks (measured: 0.4%) and its spins take the caller's time, so the pool goes solo; it probes
    again after each solo period (more parallel regions than one window) and finds the worker
    starved again. Every region gives one thread's result."""
    out = subprocess.run([sys.executable, "-c", STARVED], capture_output=True, text=True, check=True, timeout=120)
    stats = json.loads(out.stdout)
    assert stats["same"]
    assert stats["solo_periods"] >= 2
    assert stats["parallel_regions"] > 64 and stats["solo_regions"] > stats["parallel_regions"]


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 48, 49, 61, 100])
def test_linear_f32_rows_never_depend_on_their_batch(rows: int) -> None:
    """The same row, alone or among others, on any thread count: the same bits (MKL's sgemm
    differs for 1-15 and 57-61 rows); and close to a float64 matmul."""
    x, w, b = rand(100, 96, seed=7), rand(200, 96, seed=8), rand(200, seed=9)
    wi = interleave_f32(w)
    with torch_threads(1):
        full = kernels.linear_f32(x, wi, b)[:, :200]
    for threads in (1, 2):
        with torch_threads(threads):
            part = kernels.linear_f32(x[-rows:].contiguous(), wi, b)[:, :200]
        assert torch.equal(part, full[-rows:])
    exact = (x.double() @ w.double().T + b.double()).float()
    torch.testing.assert_close(full, exact, atol=1e-4, rtol=1e-5)


def test_cgroup_quotas_are_read_in_v1_and_v2(tmp_path: Path) -> None:
    (tmp_path / "kubepods" / "pod1").mkdir(parents=True)
    (tmp_path / "kubepods" / "pod1" / "cpu.max").write_text("150000 100000\n")
    v2 = tmp_path / "v2"
    v2.write_text("0::/kubepods/pod1\n")
    assert cgroup_quota(tmp_path, v2) == 1.5
    (tmp_path / "cpu,cpuacct" / "docker" / "c").mkdir(parents=True)
    (tmp_path / "cpu,cpuacct" / "docker" / "c" / "cpu.cfs_quota_us").write_text("200000\n")
    (tmp_path / "cpu,cpuacct" / "docker" / "c" / "cpu.cfs_period_us").write_text("100000\n")
    v1 = tmp_path / "v1"
    v1.write_text("4:memory:/docker/c\n3:cpu,cpuacct:/docker/c\n")
    assert cgroup_quota(tmp_path, v1) == 2.0
    (tmp_path / "kubepods" / "pod1" / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(tmp_path, v2) is None
    assert 1 <= usable_cores() <= len(os.sched_getaffinity(0))


def test_importing_kvserve_sets_openmp_where_the_user_did_not() -> None:
    code = "import os, kvserve, torch; print(os.environ.get('GOMP_SPINCOUNT'), torch.get_num_threads())"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [GOMP_SPINCOUNT, str(usable_cores())]
    mine = {**env, "OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=mine, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["None", "1"]


@pytest.mark.parametrize("first", ["torch", "kvserve"])
def test_importing_torch_first_is_named_with_its_cost(first: str) -> None:
    """Imported after torch, kvserve cannot set OpenMP's spin; it says so and what to do."""
    second = "kvserve" if first == "torch" else "torch"
    code = f"import {first}, {second}; from kvserve.threads import long_spin_warning; print(long_spin_warning())"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    if first == "kvserve":
        assert out.stdout.strip() == "None"
    else:
        assert "torch was imported before kvserve" in out.stdout and "OMP_WAIT_POLICY=passive" in out.stdout
    passive = {**env, "OMP_WAIT_POLICY": "passive"}
    out = subprocess.run([sys.executable, "-c", code], env=passive, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"


def test_a_kernel_build_reports_progress_while_it_runs(caplog: pytest.LogCaptureFixture,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiler prints nothing for a minute or more: a line every PROGRESS_PERIOD seconds."""
    monkeypatch.setattr(cpu_extension, "PROGRESS_PERIOD", 0.05)
    done = threading.Event()
    reporter = threading.Thread(target=cpu_extension._report_progress, args=(done, time.perf_counter()))
    with caplog.at_level(logging.WARNING, logger=cpu_extension.__name__):
        reporter.start()
        time.sleep(0.3)
        done.set()
        reporter.join()
    lines = [r.getMessage() for r in caplog.records if "still compiling the CPU kernels" in r.getMessage()]
    assert len(lines) >= 2 and lines[-1].endswith("s so far)")
