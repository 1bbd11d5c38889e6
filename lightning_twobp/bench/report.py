"""Writing a benchmark's result: one place for the JSON every ``--json PATH`` writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(result: Any, path: str | Path) -> None:
    """Write ``result`` as indented JSON to ``path`` (its folder created) and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
