"""Preemption by swap: host tier, then the memory-mapped tier; outputs as without preemption."""
from __future__ import annotations

import dataclasses
import json
import random
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.model_runner import StepInput
from kvserve.engine.step_plan import StepPlan

from tests.engine.test_llm_engine import GREEDY, PROMPTS, token_ids

# The tiny model's KV is 512 bytes per token: one 16-token block is 8 KiB.
SMALL_POOL = dict(kv_cache_memory="64KiB", enable_prefix_caching=False)


def assert_tiers_empty(llm: LLM) -> None:
    swap = llm.engine.swap
    assert not swap.swapped
    assert all(len(t.free) == t.num_slots for t in swap.tiers)


def test_swap_to_host_and_disk_then_resume(tiny_llm: Callable[..., LLM], tmp_path: Path) -> None:
    reference = token_ids(tiny_llm())
    llm = tiny_llm(preemption_mode="swap", host_swap_memory="8KiB", disk_swap_memory="1MiB",
                   swap_dir=str(tmp_path), **SMALL_POOL)
    assert [t.name for t in llm.engine.swap.tiers] == ["host", "disk"]
    assert list(tmp_path.glob("kvserve-swap-*"))  # the file tier is a real file
    assert token_ids(llm) == reference
    sched, swap = llm.engine.scheduler, llm.engine.swap
    assert sched.preemptions["swap"] > 0 and sched.preemptions["recompute"] == 0
    assert swap.swap_outs["host"] > 0 and swap.swap_outs["disk"] > 0
    assert swap.swap_ins == swap.swap_outs
    assert_tiers_empty(llm)


def test_full_tiers_fall_back_to_recompute(tiny_llm: Callable[..., LLM]) -> None:
    reference = token_ids(tiny_llm())
    llm = tiny_llm(preemption_mode="swap", host_swap_memory="8KiB", disk_swap_memory="0", **SMALL_POOL)
    assert token_ids(llm) == reference
    assert llm.engine.scheduler.preemptions["recompute"] > 0
    assert_tiers_empty(llm)


def test_auto_mode_swaps_when_copying_is_cheaper(tiny_llm: Callable[..., LLM]) -> None:
    reference = token_ids(tiny_llm())
    llm = tiny_llm(preemption_mode="auto", host_swap_memory="1MiB", **SMALL_POOL)
    # Recomputing costs 2 x params FLOPs per token; copying a 16-token block twice is far cheaper.
    assert llm.engine.scheduler.prefer_swap(40)
    assert token_ids(llm) == reference
    assert llm.engine.scheduler.preemptions["swap"] > 0
    assert_tiers_empty(llm)


def test_aborting_a_swapped_sequence_frees_its_slots(tiny_llm: Callable[..., LLM]) -> None:
    llm = tiny_llm(preemption_mode="swap", host_swap_memory="1MiB", **SMALL_POOL)
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    while not engine.scheduler.swapped:
        engine.step()
    victim = engine.scheduler.swapped[0]
    engine.abort(victim.request_id)
    assert victim.seq_id not in engine.swap.swapped
    for request_id in ids:
        engine.abort(request_id)
    engine.step()  # applies the copies recorded before the aborts
    assert_tiers_empty(llm)


def test_a_sequence_swapped_out_needing_the_whole_pool_comes_back(tiny_llm: Callable[..., LLM]) -> None:
    """A swapped sequence whose next token needs every block cannot leave a block of headroom for
    running ones: with nothing running it comes back (or is recomputed) instead of waiting forever."""
    long_prompt = [(7 * i) % 127 + 1 for i in range(111)]  # + 17 outputs = the pool's 8 x 16 slots
    prompts, params = [list(range(1, 6)), long_prompt], [dataclasses.replace(GREEDY, max_tokens=11),
                                                         dataclasses.replace(GREEDY, max_tokens=17)]
    reference = token_ids(tiny_llm(), prompts, params)
    llm = tiny_llm(preemption_mode="swap", host_swap_memory="1MiB", **SMALL_POOL)
    engine = llm.engine
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    outputs, steps = {}, 0
    while engine.has_unfinished() and steps < 200:
        outputs |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
        steps += 1
    assert engine.scheduler.preemptions["swap"] > 0
    assert [outputs.get(str(i)) for i in range(2)] == reference
    assert_tiers_empty(llm)


def test_a_salted_sequence_keeps_its_salt_through_a_swap(tiny_llm: Callable[..., LLM]) -> None:
    """The blocks a swapped-in sequence registers stay under its tenant's salt: another tenant
    sending the same prompt never hits them."""
    llm = tiny_llm(preemption_mode="swap", host_swap_memory="1MiB", max_num_seqs=4, kv_cache_memory="64KiB")
    engine = llm.engine
    prompts = [[(13 * i + 7 * j) % 127 + 1 for j in range(40)] for i in range(4)]
    for prompt in prompts:
        engine.add_request(prompt, dataclasses.replace(GREEDY, max_tokens=60), cache_salt="tenant-a")
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.preemptions["swap"] > 0
    stats = engine.block_manager.prefix_stats
    before = stats.cached_tokens
    llm.generate(prompts, dataclasses.replace(GREEDY, max_tokens=1), use_tqdm=False)
    assert stats.cached_tokens == before
    llm.generate(prompts, dataclasses.replace(GREEDY, max_tokens=1), use_tqdm=False)  # the control
    assert stats.cached_tokens > before


def run_with_a_failed_step(llm: LLM, kind: str | None) -> dict[str, list[int]]:
    """Seeded samples of four prompts through a pool that swaps; the first step with a `kind`
    move fails before its forward pass (after its swaps, which go first), and the requests
    running then end, as the server ends them. Returns the finished requests' tokens."""
    engine, runner = llm.engine, llm.engine.runner
    prepare, failed = runner.prepare, []
    moved = {"swap_out": engine.swap.swap_outs, "swap_in": engine.swap.swap_ins}.get(kind)

    def faulty(plan: StepPlan) -> StepInput:
        if moved is not None and moved.total() and not failed:
            failed.append(kind)
            raise RuntimeError("injected fault")
        return prepare(plan)

    runner.prepare = faulty  # type: ignore[method-assign]
    rng = random.Random(0)
    for i in range(4):
        engine.add_request([rng.randrange(1, 128) for _ in range(40)],
                           SamplingParams(max_tokens=60, seed=i, ignore_eos=True), request_id=f"r{i}")
    outputs = {}
    while engine.has_unfinished():
        try:
            outputs |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
        except RuntimeError:
            for seq in list(engine.scheduler.running):
                engine.abort(seq.request_id)
    assert failed == ([] if kind is None else [kind])
    return outputs


@pytest.mark.parametrize("kind", ["swap_out", "swap_in"])
def test_a_step_that_fails_still_applies_its_swaps(tiny_llm: Callable[..., LLM], kind: str) -> None:
    """The scheduler counts on a step's moves once it has scheduled them: a swapped-out sequence
    resumes from its copy, a swapped-in one's slots are freed. A step that fails before its
    forward pass applies them anyway: the swapped survivors' outputs stay right, no slot leaks."""
    config = dict(preemption_mode="swap", host_swap_memory="1MiB", max_num_seqs=4, kv_cache_memory="64KiB")
    reference = run_with_a_failed_step(tiny_llm(**config), None)
    llm = tiny_llm(**config)
    outputs = run_with_a_failed_step(llm, kind)
    assert len(outputs) < len(reference) and all(outputs[r] == reference[r] for r in outputs)
    if kind == "swap_out":  # its victim was swapped, not running, when the step failed
        assert outputs
    assert_tiers_empty(llm)


def test_bad_swap_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(model="random:tiny", preemption_mode="sometimes")
    with pytest.raises(ValueError, match="host_swap_memory"):
        LLM(model="random:tiny", host_swap_memory="lots")


# A child process drives the disk tier, so that a SIGBUS kills it and not the test: greedy
# outputs of four prompts through an 8-block pool that swaps every preempted sequence to disk
# (the host tier is smaller than a block), against the same engine preempting by recompute.
# argv: swap_dir, disk_swap_memory, then what befalls the tier: "fill" (after start-up, another
# file fills the filesystem); "lose" (once some sequences are on disk, the swap file is cut to
# nothing and the filesystem filled: their reads come back short, later writes find no space);
# "rlimit" (a 1 MiB file-size limit before the engine starts). Prints a JSON line.
CHILD = r"""
import json, os, random, resource, sys
from pathlib import Path
from kvserve import LLM, SamplingParams
from tests.conftest import TINY

swap_dir, disk, fault = sys.argv[1:4]
base = dict(model=TINY, dtype="float32", device="cpu", max_model_len=256, kv_cache_memory="64KiB",
            max_num_seqs=4, enable_prefix_caching=False)
rng = random.Random(0)
prompts = [[rng.randrange(1, 128) for _ in range(40)] for _ in range(4)]
params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
want = [o.token_ids for o in LLM(**base).generate(prompts, params, use_tqdm=False)]
if fault == "rlimit":
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    llm = LLM(**base, preemption_mode="swap", host_swap_memory="1KiB", disk_swap_memory=disk, swap_dir=swap_dir)
except ValueError as err:
    print(json.dumps({"refused": str(err)}))
    sys.exit()

def fill():
    fd = os.open(os.path.join(swap_dir, "filler"), os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, bytes(4096)):
            pass
    except OSError:  # no space left
        os.close(fd)

engine = llm.engine
if fault == "fill":
    fill()
ids = [engine.add_request(p, params) for p in prompts]
got = {}
while engine.has_unfinished():
    got |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    if fault == "lose" and engine.scheduler.swapped and not os.path.exists(os.path.join(swap_dir, "filler")):
        for path in Path(swap_dir).glob("kvserve-swap-*"):
            os.truncate(path, 0)
        fill()
swap = engine.swap
print(json.dumps({"same": [got[i] for i in ids] == want, "swapped_to_disk": swap.swap_outs["disk"],
                  "failures": swap.failures, "preemptions": engine.scheduler.preemptions,
                  "tiers_free": all(len(t.free) == t.num_slots for t in swap.tiers) and not swap.swapped}))
"""


def run_child(swap_dir: Path, disk: str, fault: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(swap_dir), disk, fault], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, (
        f"the engine died of {signal.Signals(-done.returncode).name}" if done.returncode < 0 else done.stderr[-3000:])
    return json.loads(done.stdout.splitlines()[-1]) | {"stderr": done.stderr}


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB filesystem (a tmpfs: mounting one needs root, the test skips without)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_disk_tier_larger_than_its_filesystem_is_refused_at_start(tiny_fs: Path) -> None:
    """64 MiB on a 1 MiB filesystem, which other files then fill: the file was sparse, and the
    first swap-out onto a page with no disk behind it killed the process with SIGBUS. Now its
    space is reserved at start-up, which fails, naming the field, the place and its free space."""
    out = run_child(tiny_fs, "64MiB", "fill")
    assert "EngineConfig.disk_swap_memory" in out["refused"] and str(tiny_fs) in out["refused"]
    assert "free there" in out["refused"]
    assert not list(tiny_fs.glob("kvserve-swap-*"))  # nothing left behind


def test_a_file_size_limit_refuses_the_disk_tier_at_start(tmp_path: Path) -> None:
    """The same with a 1 MiB file-size limit (no root needed): a bare OSError from inside the
    swap space before, an error naming the field now."""
    out = run_child(tmp_path, "64MiB", "rlimit")
    assert "EngineConfig.disk_swap_memory" in out["refused"] and "File too large" in out["refused"]


def test_the_disk_tiers_space_is_its_own_once_started(tiny_fs: Path) -> None:
    """A tier that fits, then another file fills the filesystem: the tier's blocks were reserved
    (the sparse file's first swap-out was a SIGBUS), so every swap still lands."""
    out = run_child(tiny_fs, "256KiB", "fill")
    assert out["same"] and out["swapped_to_disk"] > 0 and not out["failures"] and out["tiers_free"]


def test_a_disk_tier_failing_at_run_time_falls_back_to_recompute(tiny_fs: Path) -> None:
    """The swap file cut to nothing on a full filesystem while sequences are on it: their reads
    come back short and later writes find no space. Each sequence whose pages were lost is
    recomputed, with the outputs of an engine that never swapped; no slot leaks."""
    out = run_child(tiny_fs, "256KiB", "lose")
    assert out["same"] and out["tiers_free"], out
    assert out["failures"].get("disk in", 0) > 0 and out["failures"].get("disk out", 0) > 0, out
    assert out["preemptions"]["recompute"] > 0
    assert "the disk swap tier failed to swap in" in out["stderr"]
