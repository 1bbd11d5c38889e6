"""lightning_twobp: pipeline-parallel training with 2BP, 2-stage backpropagation.

Importing the package registers ``strategy="twobp"`` with Lightning (Lightning has no entry-point
discovery for strategies, so a third-party strategy registers itself on import): at once when
Lightning is loaded, else when it loads (:mod:`lightning_twobp.registration`). The names below load
on first use, so ``import lightning_twobp.schedules`` imports neither torch nor Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_twobp.registration import register_with_lightning

__version__ = "0.1.0"

__all__ = ["HookScaleError", "NonFiniteError", "PipelineMonitor", "Preempted", "TwoBPStrategy"]

_LAZY = {
    "HookScaleError": "lightning_twobp.lightning",
    "NonFiniteError": "lightning_twobp.lightning",
    "PipelineMonitor": "lightning_twobp.monitor",
    "Preempted": "lightning_twobp.lightning",
    "TwoBPStrategy": "lightning_twobp.lightning",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'lightning_twobp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


register_with_lightning()
