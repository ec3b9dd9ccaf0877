"""Rewrite the options table in README.md and docs/design.md from opweave.pipeline.OPTIONS (a test keeps them equal).

    .venv/bin/python scripts/options_table.py
"""

from __future__ import annotations

import re
from pathlib import Path

from opweave.pipeline.options import options_markdown

ROOT = Path(__file__).resolve().parent.parent
TABLE = re.compile(r"\| option \| meaning \| devices \| default \|[^\n]*\n(?:\|.*\|\n)+")

for doc in ("README.md", "docs/design.md"):
    path = ROOT / doc
    text, count = TABLE.subn(options_markdown() + "\n", path.read_text(), count=1)
    if count != 1:
        raise SystemExit(f"{doc}: no options table to rewrite")
    path.write_text(text)
    print(f"rewrote the options table of {doc}")
