"""A per-layer KV format plan: which format each layer's keys and values are stored in.

`kv_cache_dtype="plan:PATH"` loads one. The file is JSON:

    {"version": 1, "layers": [{"k": "int8", "v": "int4"}, {"k": "bf16", "v": "bf16"}, ...],
     "note": "free text, e.g. how the plan was chosen"}

one entry per decoder layer, each naming a registered format (kvserve.cache.formats; "auto": the
model dtype). The pool then holds blocks whose layers are stored in different formats within one
budget.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvserve.cache.formats import FORMAT_CHOICES

PLAN_PREFIX = "plan:"
PLAN_VERSION = 1


@dataclass(frozen=True)
class KVPlan:
    layers: tuple[tuple[str, str], ...]  # (keys, values) format name per layer
    note: str = ""

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("kv plan: layers must name at least one layer")
        for i, pair in enumerate(self.layers):
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise ValueError(f"kv plan: layers[{i}] must be a (keys, values) pair, got {pair!r}")
            for role, name in zip("kv", pair):
                if name != "auto" and name not in FORMAT_CHOICES:
                    raise ValueError(f"kv plan: layers[{i}].{role} must be 'auto' or one of "
                                     f"{', '.join(FORMAT_CHOICES)}, got {name!r}")

    @classmethod
    def load(cls, path: str | Path) -> "KVPlan":
        """Reads a plan file; errors name the file and the field."""
        if not str(path).strip():
            raise ValueError("kv plan: 'plan:' names no file; write plan:PATH (a plan kvserve tune-kv wrote)")
        try:
            data = json.loads(Path(path).read_text())
        except OSError as err:
            raise ValueError(f"kv plan {path}: cannot read it ({err.strerror})") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"kv plan {path}: not JSON ({err})") from None
        if not isinstance(data, dict):
            raise ValueError(f"kv plan {path}: must be a JSON object with 'version' and 'layers'")
        if data.get("version") != PLAN_VERSION:
            raise ValueError(f"kv plan {path}: version must be {PLAN_VERSION}, got {data.get('version')!r}")
        layers = data.get("layers")
        if not isinstance(layers, list):
            raise ValueError(f"kv plan {path}: layers must be a list of {{'k': ..., 'v': ...}} objects")
        pairs = []
        for i, layer in enumerate(layers):
            if not isinstance(layer, dict) or set(layer) != {"k", "v"}:
                raise ValueError(f"kv plan {path}: layers[{i}] must be an object with exactly 'k' and 'v', "
                                 f"got {layer!r}")
            pairs.append((layer["k"], layer["v"]))
        note = data.get("note", "")
        if not isinstance(note, str):
            raise ValueError(f"kv plan {path}: note must be a string")
        try:
            return cls(tuple(pairs), note)
        except ValueError as err:
            raise ValueError(str(err).replace("kv plan:", f"kv plan {path}:", 1)) from None

    def save(self, path: str | Path) -> None:
        layers = [{"k": k, "v": v} for k, v in self.layers]
        Path(path).write_text(json.dumps({"version": PLAN_VERSION, "layers": layers, "note": self.note}, indent=1)
                              + "\n")


def plan_path(kv_cache_dtype: str) -> str | None:
    """The plan file a `kv_cache_dtype` value names, or None for a plain format name."""
    return kv_cache_dtype[len(PLAN_PREFIX):] if kv_cache_dtype.startswith(PLAN_PREFIX) else None
