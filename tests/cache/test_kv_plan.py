"""Per-layer KV format plans: the file round-trips, and bad files fail naming the field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.cache.kv_plan import KVPlan, plan_path
from kvserve.config import EngineConfig


def test_a_plan_round_trips(tmp_path: Path) -> None:
    plan = KVPlan((("int8", "int4"), ("auto", "auto"), ("kivi4", "fp8_e4m3")), note="hand-made")
    plan.save(tmp_path / "plan.json")
    assert KVPlan.load(tmp_path / "plan.json") == plan
    assert plan_path(f"plan:{tmp_path / 'plan.json'}") == str(tmp_path / "plan.json")
    assert plan_path("int8") is None


@pytest.mark.parametrize("content, field", [
    ("{not json", "not JSON"),
    ('[1, 2]', "JSON object"),
    ('{"version": 2, "layers": []}', "version must be 1"),
    ('{"version": 1, "layers": {"k": "int8"}}', "layers must be a list"),
    ('{"version": 1, "layers": []}', "at least one layer"),
    ('{"version": 1, "layers": [{"k": "int8", "v": "int8"}, {"k": "int3", "v": "int8"}]}', r"layers\[1\]\.k"),
    ('{"version": 1, "layers": [{"k": "int8"}]}', r"layers\[0\] must be an object with exactly 'k' and 'v'"),
    ('{"version": 1, "layers": [{"k": "int8", "v": "int8"}], "note": 3}', "note must be a string"),
])
def test_bad_plan_files_name_the_field(tmp_path: Path, content: str, field: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=field):
        KVPlan.load(path)
    with pytest.raises(ValueError, match=f"KVFormatOptions.kv_cache_dtype: kv plan {path}"):
        EngineConfig.of(kv_cache_dtype=f"plan:{path}")


def test_a_missing_plan_or_role_overrides_beside_one_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="KVFormatOptions.kv_cache_dtype: kv plan .*cannot read it"):
        EngineConfig.of(kv_cache_dtype=f"plan:{tmp_path / 'absent.json'}")
    with pytest.raises(ValueError, match="KVFormatOptions.kv_cache_dtype: kv plan: 'plan:' names no file"):
        EngineConfig.of(kv_cache_dtype="plan:")  # it said "Is a directory": the empty path is "."
    path = tmp_path / "plan.json"
    KVPlan((("int8", "int8"),)).save(path)
    with pytest.raises(ValueError, match="KVFormatOptions.kv_cache_dtype_k"):
        EngineConfig.of(kv_cache_dtype=f"plan:{path}", kv_cache_dtype_k="int4")
    assert json.loads(path.read_text())["version"] == 1
