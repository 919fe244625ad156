"""Writes the reference's flag, metric and OTLP instrument tables from their one definition in the code.

    .venv/bin/python scripts/doc_tables.py          # rewrite the tables in docs/configuration.md and docs/metrics.md
    (tests/test_docs.py fails when a page differs from what this would write)
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from proxy.config import OPTIONS  # noqa: E402
from proxy.measure.meters import INSTRUMENTS  # noqa: E402
from proxy.measure.metrics import METRICS  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = (DOCS / "configuration.md", DOCS / "metrics.md")  # (each page holds the tables it has markers for)


def flags_table() -> str:
    rows = [f"| `{o.flag}` | `{o.env}` | `{o.default!r}` | {o.help} |" for o in OPTIONS]
    return "\n".join(["| flag | environment | default | meaning |", "|---|---|---|---|", *rows])


def metrics_table() -> str:
    rows = [f"| `{d.exposed}` | {d.kind} | {', '.join(d.labels)} | {d.doc} |" for d in METRICS]
    return "\n".join(["| metric | type | labels | definition |", "|---|---|---|---|", *rows])


def instruments_table() -> str:
    rows = [f"| `{d.name}` | {d.kind} | `{d.unit}` | {d.doc} |" for d in INSTRUMENTS]
    return "\n".join(["| instrument | type | unit | definition |", "|---|---|---|---|", *rows])


def render(text: str) -> str:
    for name, table in (("flags", flags_table()), ("metrics", metrics_table()), ("instruments", instruments_table())):
        text = re.sub(rf"(<!-- {name}:start -->\n).*?(\n<!-- {name}:end -->)", lambda m: m.group(1) + table + m.group(2), text, flags=re.S)
    return text


if __name__ == "__main__":
    for page in PAGES:
        page.write_text(render(page.read_text()))
        print(f"wrote the tables in {page}")
