"""One Prometheus page from every replica's: each sample gains a `replica` label, and families
keep one HELP / TYPE header."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def merge_metrics(pages: dict[str, str]) -> bytes:
    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica, text in sorted(pages.items()):
        for family in text_string_to_metric_families(text):
            _, _, lines = families.setdefault(family.name, (family.documentation, family.type, []))
            for sample in family.samples:
                labels = {"replica": replica, **sample.labels}
                rendered = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                lines.append(f"{sample.name}{{{rendered}}} {sample.value!r}")
    out = []
    for name, (doc, kind, lines) in families.items():
        # The parser names a counter's family without its `_total`; the text format names it with.
        shown = f"{name}_total" if kind == "counter" else name
        out += [f"# HELP {shown} {_escape(doc)}", f"# TYPE {shown} {'untyped' if kind == 'unknown' else kind}", *lines]
    return ("\n".join(out) + "\n").encode()
