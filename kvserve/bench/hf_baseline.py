"""HuggingFace transformers baseline: static padded batches through `generate`."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_model
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StoppingCriteria,
    StoppingCriteriaList,
)

from kvserve.bench.metrics import RequestTiming
from kvserve.bench.workload import WorkloadRequest
from kvserve.model.gguf_convert import cached_conversion, convert_gguf, publish


def load_hf_model(
    gguf_path: str, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """HF transformers' own reading of a GGUF, independent of kvserve's conversion (the parity
    tests and eval's HF rows check ours against it). Transformers parses the file three times
    (config, tokenizer, weights) and dequantizes in numpy, ~35 s for the bundled model, so its
    result is saved once per file and transformers version as an HF directory in the cache, and
    later loads read that."""
    path = Path(gguf_path).resolve()
    out = cached_conversion(path, prefix=f"hf-{transformers.__version__}-")
    if not (out / "config.json").exists():
        # local_files_only keeps transformers from touching the Hub.
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                     local_files_only=True)

        def write(tmp: Path) -> None:
            # The weights are dequantized already (transformers' save_pretrained refuses a model
            # loaded from GGUF): the plain tensors and the config without its GGUF marker.
            config = copy.deepcopy(model.config)
            del config.quantization_config
            config.save_pretrained(tmp)
            save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            tokenizer.save_pretrained(tmp)

        publish(out, write)
    return load_hf_dir(out, dtype)


def load_hf_dir(directory: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    model.eval()
    return model, tokenizer


def hf_bench_dir(source: str) -> Path:
    """The HF directory of exactly the weights kvserve runs: a GGUF goes through kvserve's own
    one-time conversion to an HF directory (dequantized), so both engines multiply the same bf16
    tensors; transformers' GGUF loader would keep them packed and dequantize in every matmul.
    (The parity tests load the GGUF with HF's loader instead, to check that conversion.)"""
    return convert_gguf(Path(source)) if source.endswith(".gguf") else Path(source)


def load_hf_bench_model(source: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """HF transformers on the dense weights of `hf_bench_dir`."""
    return load_hf_dir(hf_bench_dir(source), dtype)


class _StepClock(StoppingCriteria):
    """Timestamps each decode step; `generate` calls it right after appending a token."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor | None, **kwargs: object) -> torch.BoolTensor:
        # On GPU the token is not really ready until queued kernels finish.
        if input_ids.is_cuda:
            torch.cuda.synchronize(input_ids.device)
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _left_pad(
    prompts: list[list[int]], pad_token_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    # Left padding keeps every row's last prompt token in the final column,
    # which is where a decoder-only model's next token is read from.
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def run_hf_static_batches(
    model: PreTrainedModel,
    requests: list[WorkloadRequest],
    batch_size: int,
    pad_token_id: int,
    progress: bool = True,
) -> tuple[list[RequestTiming], float]:
    """Every request arrives at the start; returns per-request timings and wall seconds."""
    timings: list[RequestTiming] = []
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in tqdm(batches, desc="hf generate", unit="batch", disable=not progress):
            input_ids, attention_mask = _left_pad(
                [r.prompt_token_ids for r in batch], pad_token_id, model.device
            )
            # Static batching: the whole batch decodes until its longest request is
            # done; min_new_tokens stops EOS from ending it early, matching the
            # engine's ignore_eos benchmark mode.
            stamps = _timed_generate(model, input_ids, attention_mask,
                                     max(r.max_tokens for r in batch), pad_token_id)
            # A request's useful work ends at its own max_tokens; later steps are
            # padding waste that static batching forces on it.
            timings.extend(
                RequestTiming(
                    prompt_len=len(r.prompt_token_ids),
                    output_len=r.max_tokens,
                    arrival=t0,
                    first_token=stamps[0],
                    finish=stamps[r.max_tokens - 1],
                )
                for r in batch
            )
    return timings, time.perf_counter() - t0


def _timed_generate(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    steps: int, pad_token_id: int) -> list[float]:
    """Greedy `generate` for exactly `steps` tokens; returns when each token was ready."""
    clock = _StepClock()
    model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=steps,
                   min_new_tokens=steps, do_sample=False, pad_token_id=pad_token_id,
                   stopping_criteria=StoppingCriteriaList([clock]))
    return clock.stamps


def hf_step_times(model: PreTrainedModel, prompt_ids: list[int], num_tokens: int,
                  pad_token_id: int) -> list[float]:
    """Seconds each generated token took for one sequence alone (the first includes prefill)."""
    ids = torch.tensor([prompt_ids], device=model.device)
    with torch.inference_mode():
        start = time.perf_counter()
        stamps = _timed_generate(model, ids, torch.ones_like(ids), num_tokens, pad_token_id)
    return [b - a for a, b in zip([start, *stamps], stamps)]


def run_hf_continuous_batching(model: PreTrainedModel, requests: list[WorkloadRequest], max_batch: int,
                               progress: bool = True, num_blocks: int | None = None
                               ) -> tuple[list[RequestTiming], float]:
    """HF transformers' own continuous batching (`init_continuous_batching`, paged cache): every
    request added at t=0, greedy, EOS ignored (no eos_token_id) so each runs to its max_tokens.
    `num_blocks` sizes its cache; None lets HF size it from free memory, which on a CPU is the
    host's: ~13 GiB for a tiny model on a 24 GiB machine (benchmarks/gpu.py --tiny was killed for
    memory beside other jobs)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in requests),
                              eos_token_id=None, pad_token_id=0)
    manager = model.init_continuous_batching(
        generation_config=config,
        continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=max_batch, num_blocks=num_blocks))
    manager.start()
    try:
        # Its first batch pays a one-time warm-up (~25 s here): outside the clock, as kvserve's
        # kernel build and first steps are.
        manager.add_request(requests[0].prompt_token_ids, request_id="warm-up", max_new_tokens=2, eos_token_id=-1)
        if manager.get_result(timeout=3600) is None:
            raise RuntimeError("HF continuous batching failed to warm up")
        t0 = time.perf_counter()
        for i, r in enumerate(requests):
            manager.add_request(r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.max_tokens,
                                record_timestamps=True, eos_token_id=-1)
        done: dict[str, RequestTiming] = {}
        with tqdm(total=len(requests), desc="hf continuous batching", unit="req", disable=not progress) as bar:
            while len(done) < len(requests):
                # Results come in the order requests finish; None means a timeout or a dead worker.
                out = manager.get_result(timeout=3600)
                if out is None or out.error:
                    raise RuntimeError(f"HF continuous batching failed: {out and out.error or 'no result'}")
                r = requests[int(out.request_id[1:])]
                stamps = out.timestamps or [time.perf_counter()]
                done[out.request_id] = RequestTiming(len(r.prompt_token_ids), len(out.generated_tokens), t0,
                                                     stamps[0], stamps[-1])
                bar.update(1)
        timings = [done[f"r{i}"] for i in range(len(requests))]
        wall = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    return timings, wall
