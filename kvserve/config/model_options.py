"""The model part of the configuration: which weights, in which dtype, on which device."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.config.options import Options, opt
from kvserve.model.config import ModelConfig
from kvserve.validate import FieldError

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


@dataclass(frozen=True)
class ModelOptions(Options):
    model: str | Path | ModelConfig | None = opt(
        None, "a .gguf file, a Hugging Face model directory, or random:<preset> (default: the bundled "
              "SmolLM2-135M-Instruct)")
    dtype: str = opt("bfloat16", "model dtype", choices=sorted(DTYPES))
    device: str = opt("auto", "auto (cuda if present), cpu, cuda or cuda:N")
    max_model_len: int | None = opt(None, "context length (default: the model's)")
    # Sampling has its own --seed; this one seeds random weights and unseeded requests.
    seed: int = opt(0, "seeds random-weight models and requests without a seed", flag="engine-seed")

    def _check(self) -> None:
        self._one_of("dtype", sorted(DTYPES))
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            raise FieldError("device", f"ModelOptions.device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda"):
            self._check_cuda()
        self._positive("max_model_len")

    def _check_cuda(self) -> None:
        if not torch.cuda.is_available():
            why = "this torch has no CUDA" if torch.version.cuda is None else "no GPU is visible"
            raise FieldError("device", f"ModelOptions.device is {self.device!r} but {why}; use 'cpu' or 'auto'")
        index = torch.device(self.device).index
        if index is not None and index >= torch.cuda.device_count():
            raise FieldError("device", f"ModelOptions.device is {self.device!r} but only "
                                       f"{torch.cuda.device_count()} GPU(s) are visible")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
