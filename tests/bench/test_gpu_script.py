"""benchmarks/gpu.py runs only where a GPU is lent; its --tiny mode keeps it honest on a CPU."""
from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu.py"


def test_gpu_benchmark_script_runs_tiny(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.main(["--tiny", "--requests", "6", "--out", str(tmp_path)])
    assert (tmp_path / "gpu.json").exists()
    assert not [name for name, row in rows.items() if "error" in row]
    ours = rows["kvserve_eager"]  # no CUDA graphs on the CPU
    assert ours["mixed_output_tok_s"] > 0 and rows["hf"]["cb_mixed_output_tok_s"] > 0
    # Both engines ran the same requests: the ratio is theirs, not a constant.
    assert rows["ratios"]["mixed_vs_hf_cb"] == ours["mixed_output_tok_s"] / rows["hf"]["cb_mixed_output_tok_s"]
