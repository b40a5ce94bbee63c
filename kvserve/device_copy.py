"""Host-to-device copies that do not wait for the device."""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` (on the host) on `device`, as `dtype`. To a GPU through pinned memory without blocking:
    a copy from pageable memory synchronizes its stream, so with async scheduling the next step's
    metadata would wait for the whole current step to finish before its launch."""
    if dtype is not None:
        t = t.to(dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
