"""Evaluation helpers: quality of KV-cache formats against reference baselines."""
