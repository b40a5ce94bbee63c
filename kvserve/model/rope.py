"""RoPE frequencies: the plain ones, linear scaling and Llama 3.x's, read from a Hugging Face config.

A config names its RoPE as `rope_parameters` (transformers 5) or `rope_scaling` (earlier files,
`type` or `rope_type`), with `rope_theta` inside it or at the top level. Gemma 3 has one set per
layer kind (`rope_parameters.full_attention` / `.sliding_attention`, or in earlier files
`rope_theta` + `rope_scaling` for the full layers and `rope_local_base_freq` for the sliding ones).
Types kvserve does not compute are refused naming the field, never run as plain RoPE: the logits
would differ.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvserve.model.architectures import UnsupportedModel

IMPLEMENTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """`rope_type: llama3` (Llama 3.1+): low frequencies divided by `factor`, high ones kept, a
    smooth blend between, by wavelength against the pre-training context."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int

    def __post_init__(self) -> None:
        if not (self.factor > 0 and self.original_max_position > 0
                and 0 < self.low_freq_factor < self.high_freq_factor):
            raise ValueError(f"rope_scaling: llama3 needs factor > 0, original_max_position_embeddings > 0 and "
                             f"0 < low_freq_factor < high_freq_factor, got {self}")

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """transformers' `_compute_llama3_parameters`, step for step (fp32), so the tables agree bit for bit."""
        low_freq_wavelen = self.original_max_position / self.low_freq_factor
        high_freq_wavelen = self.original_max_position / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)

    def to_hf_dict(self) -> dict[str, float | int | str]:
        return {"rope_type": "llama3", "factor": self.factor, "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position}


@dataclass(frozen=True)
class LinearRopeScaling:
    """`rope_type: linear` (Gemma 3 4B+ on its full layers): every frequency divided by `factor`."""
    factor: float

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"rope_scaling: linear needs factor > 0, got {self.factor}")

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        return inv_freq / self.factor

    def to_hf_dict(self) -> dict[str, float | int | str]:
        return {"rope_type": "linear", "factor": self.factor}


RopeScaling = Llama3RopeScaling | LinearRopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """fp32 [head_dim / 2], on the CPU (see `RotaryEmbedding`)."""
    cpu = torch.device("cpu")
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=cpu) / head_dim)
    return inv_freq if scaling is None else scaling.apply(inv_freq)


def rope_from_hf(d: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from a config.json; anything but plain, linear or llama3 RoPE refused."""
    key = next((k for k in ("rope_parameters", "rope_scaling") if d.get(k) is not None), None)
    params: dict = d[key] if key is not None else {}
    if key is not None and not isinstance(params, dict):
        raise UnsupportedModel(f"{key}: expected an object of RoPE parameters, got {params!r}")
    theta = float(d.get("rope_theta") or params.get("rope_theta") or 10000.0)
    partial = next((v for v in (d.get("partial_rotary_factor"), params.get("partial_rotary_factor"))
                    if v is not None), 1.0)
    if partial != 1.0:
        field = "partial_rotary_factor" if "partial_rotary_factor" in d else f"{key}.partial_rotary_factor"
        raise UnsupportedModel(f"{field}: {partial}: RoPE over part of a head is not implemented")
    return theta, _scaling(params, key or "rope_parameters", d.get("max_position_embeddings", 2048))


def layered_rope_from_hf(d: dict) -> tuple[float, RopeScaling | None, float]:
    """Gemma 3's (full layers' theta, their scaling, sliding layers' theta), as transformers'
    Gemma3TextConfig reads them, defaults included (1e6 and 1e4). Scaling on the sliding layers is
    refused: no Gemma 3 has it."""
    params = d.get("rope_parameters")
    if params is None:  # files from before transformers 5
        legacy = d.get("rope_scaling") or {}
        if not isinstance(legacy, dict):
            raise UnsupportedModel(f"rope_scaling: expected an object of RoPE parameters, got {legacy!r}")
        params = {"full_attention": {"rope_theta": d.get("rope_theta", 1e6), **legacy},
                  "sliding_attention": {"rope_theta": d.get("rope_local_base_freq", 1e4)}}
    if not isinstance(params, dict) or not set(params) <= {"full_attention", "sliding_attention"}:
        raise UnsupportedModel(f"rope_parameters: expected full_attention / sliding_attention RoPE parameters, "
                               f"got {params!r}")
    full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    context = d.get("max_position_embeddings", 131072)
    if _scaling(local, "rope_parameters.sliding_attention", context) is not None:
        raise UnsupportedModel("rope_parameters.sliding_attention: RoPE scaling on the sliding layers is not "
                               "implemented")
    return (float(full.get("rope_theta", 1e6)), _scaling(full, "rope_parameters.full_attention", context),
            float(local.get("rope_theta", 1e4)))


def _scaling(params: dict, key: str, context: int) -> RopeScaling | None:
    """The scaling one set of RoPE parameters names (`key`: where they are, for errors)."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind not in IMPLEMENTED_ROPE_TYPES:
        name = "rope_type" if "rope_type" in params else "type"
        raise UnsupportedModel(f"{key}.{name}: {kind!r} is not implemented (kvserve computes "
                               f"{', '.join(IMPLEMENTED_ROPE_TYPES)})")
    try:
        if kind == "linear":
            return LinearRopeScaling(float(params["factor"]))
        return Llama3RopeScaling(
            factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            # transformers fills a missing one with the model's context, as here.
            original_max_position=int(params.get("original_max_position_embeddings", context)))
    except KeyError as err:  # a damaged file, not an unsupported model: the loader says so
        raise ValueError(f"{key}: {kind} RoPE needs {err.args[0]}") from None
