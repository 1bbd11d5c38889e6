"""Refusals before any compute that need no pipeline: options of the wrong type, a launch that cannot
start, optimizers the pipeline cannot step. Each error names the value and the fix
(docs/troubleshooting.md keeps a row per error)."""

from __future__ import annotations

from typing import Any

__all__ = ["check_flag"]


def check_flag(name: str, value: Any, none: str | None = None) -> None:
    """``value`` is a bool (or ``None`` where ``none`` says what ``None`` means). A string is refused:
    ``"false"`` and ``"no"`` are truthy, so ``if value:`` would take them as true."""
    if isinstance(value, bool) or (value is None and none is not None):
        return
    allowed = "True or False" + (f", or None ({none})" if none is not None else "")
    raise ValueError(
        f"TwoBPStrategy({name}={value!r}): it must be {allowed}, not a {type(value).__name__}; pass a bool "
        f"(e.g. {name}=False). On the command line Hydra and LightningCLI read true/false as booleans: "
        f"strategy.{name}=false"
    )
