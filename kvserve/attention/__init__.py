"""Attention backends: each owns how attention reads and writes the paged pool (see backend.py)."""
from kvserve.attention.backend import AttentionBackend, StepAttention
from kvserve.attention.metadata import StepMetadata
from kvserve.attention.selector import BACKEND_NAMES, make_backend

__all__ = ["AttentionBackend", "StepAttention", "StepMetadata", "BACKEND_NAMES", "make_backend"]
