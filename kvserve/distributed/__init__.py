"""Tensor parallelism over torch.distributed: one engine, its heads and MLP split across ranks."""
