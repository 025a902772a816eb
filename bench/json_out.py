"""How a benchmark hands over its result: ``emit(doc, out_path)`` prints the document as JSON on
stdout and, when ``out_path`` is given, writes the same text (and a final newline) to that file."""

from __future__ import annotations

import json
from pathlib import Path


def emit(doc: dict, out_path: str | None) -> None:
    text = json.dumps(doc, indent=1)
    print(text)
    if out_path:
        Path(out_path).write_text(text + "\n")
