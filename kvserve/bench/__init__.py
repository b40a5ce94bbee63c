"""Benchmark harness: synthetic WikiText workloads, latency metrics and the HF baseline."""
