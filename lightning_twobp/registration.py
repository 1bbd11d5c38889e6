"""``strategy="twobp"`` registered with Lightning when Lightning loads, not when this package does.

Lightning has no entry-point discovery for strategies, so a third-party strategy registers itself
with ``StrategyRegistry`` from its own import. Importing the strategy here would load torch and
Lightning (seconds) for every ``import lightning_twobp.schedules``, which is pure Python. So
:func:`register_with_lightning` registers at once when ``lightning.pytorch`` is already loaded, and
otherwise puts a one-shot finder on ``sys.meta_path`` that lets the normal finders load
``lightning.pytorch`` and imports the strategy module (which registers) right after it has run. Any
user who can write ``Trainer(strategy="twobp")`` has loaded ``lightning.pytorch`` by then.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any

__all__ = ["register_with_lightning"]

LIGHTNING = "lightning.pytorch"
STRATEGY = "lightning_twobp.lightning.strategy"  # registers "twobp" when imported


def register_with_lightning() -> None:
    """Register ``strategy="twobp"`` now if Lightning is loaded, else as soon as it is."""
    if LIGHTNING in sys.modules:
        importlib.import_module(STRATEGY)
    elif not any(isinstance(f, _WhenLightningLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenLightningLoads())


class _WhenLightningLoads(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of ``lightning.pytorch`` once, then steps aside."""

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> Any:
        if fullname != LIGHTNING:
            return None
        sys.meta_path.remove(self)  # one shot, and out of the way of the real lookup below
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenRegister(spec.loader)
        return spec


class _ThenRegister(importlib.abc.Loader):
    """The real loader, and the strategy's import once the module has run."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        assert module.__spec__ is not None  # the import system executes a module made from its spec
        module.__loader__ = module.__spec__.loader = self._loader  # Lightning's module as it would have been
        importlib.import_module(STRATEGY)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, get_data, ... of the real loader
        return getattr(self._loader, name)
