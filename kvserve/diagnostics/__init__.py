"""Tools that explain the engine: `kvserve memory` (memory_planner.py, arithmetic on a model's
shape, no weights loaded; kv_group_pricing.py prices each layer's pages and what sliding-window
layer groups hold) and `kvserve doctor` (doctor.py: correctness checks through the real
engine, checks.py, and where a decode step's time goes, performance.py)."""
