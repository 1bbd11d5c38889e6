"""The package keeps the shape issue 19 gave it: no function over 80 lines (a long function is a module's
worth of steps without names)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "lightning_twobp"
MOST = 80


def test_no_function_in_the_package_is_over_80_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MOST:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split these into named steps:\n" + "\n".join(long)
