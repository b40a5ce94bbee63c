"""The HF peer timed in a process of its own: it runs with OpenMP's default spin, not the one
`import kvserve` sets here, and times the same generation as `hf_step_times` in this process."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve.bench.hf_process import OPENMP_DEFAULT_SPINCOUNT, HFProcess
from kvserve.bench.workload import WorkloadRequest
from kvserve.model.gguf_convert import convert_gguf
from kvserve.model.loader import default_model_path, hf_state_dict, load_model, load_tokenizer
from tests.conftest import TINY


def test_the_peer_runs_in_its_own_process_with_openmps_spin(tmp_path: Path) -> None:
    model = LlamaForCausalLM(LlamaConfig(**TINY.to_hf_dict()))
    model.load_state_dict(hf_state_dict(load_model(TINY, torch.float32, torch.device("cpu")).model), strict=False)
    model.save_pretrained(tmp_path)
    load_tokenizer(convert_gguf(default_model_path())).save_pretrained(tmp_path)  # the bench loads one too
    before = os.environ.get("GOMP_SPINCOUNT")
    peer = HFProcess(str(tmp_path), torch.float32, 1)
    try:
        assert os.environ.get("GOMP_SPINCOUNT") == before  # this process's setting is left alone
        times = peer.step_times([5, 17, 3, 99], 6)
        assert len(times) == 6 and all(t > 0 for t in times)
        child_env = peer.environment()
        assert child_env["GOMP_SPINCOUNT"] == OPENMP_DEFAULT_SPINCOUNT
        requests = [WorkloadRequest([5, 17, 3], 4), WorkloadRequest([9, 2, 44, 61, 7], 3)]
        timings, wall = peer.batches("static", requests, 2)
        assert len(timings) == 2 and wall > 0
    finally:
        peer.close()
