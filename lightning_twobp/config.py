"""Where twobp-train and twobp-plan find their Hydra configs, and the ``recipe=`` spelling.

``conf/`` holds the composable groups (model, data, trainer, strategy, schedule, callbacks, logger) and
``recipes/`` the complete named runs. Hydra names a config group after its directory, so the recipes
are the group ``recipes``, found through a search path to the directory above ``conf/``; users write
``recipe=NAME`` (one run, one recipe), which is rewritten to ``recipes=NAME`` here, after checking that
the recipe exists (Hydra's own message for a typo is a long list of search paths).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CONF_DIR", "RECIPES_DIR", "hydra_overrides", "recipes"]

_ROOT = Path(os.environ.get("TWOBP_CONFIG_ROOT", Path(__file__).resolve().parent.parent))
CONF_DIR = _ROOT / "conf"
RECIPES_DIR = _ROOT / "recipes"


def recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def _check_root() -> None:
    if not (CONF_DIR / "config.yaml").is_file():
        raise FileNotFoundError(
            f"no Hydra configs at {CONF_DIR}: install lightning_twobp from its repository with "
            f"`pip install -e .`, or point TWOBP_CONFIG_ROOT at a directory holding conf/ and recipes/"
        )


def hydra_overrides(args: list[str]) -> list[str]:
    """Command-line overrides for Hydra: ``recipe=`` becomes ``recipes=``, unknown recipes fail here,
    and the search path that makes ``recipes/`` a config group is added."""
    _check_root()
    out = []
    for a in args:
        key, sep, value = a.partition("=")
        if sep and key.lstrip("+~") in ("recipe", "recipes"):
            known = recipes()
            for name in value.split(","):  # a -m sweep lists several
                if name.strip() not in known:
                    raise SystemExit(
                        f"unknown recipe {name.strip()!r}: choose one of {', '.join(known)} (files in {RECIPES_DIR})"
                    )
            a = f"{key.replace('recipes', 'recipe').replace('recipe', 'recipes')}={value}"
        out.append(a)
    if not any(a.startswith("hydra.searchpath=") for a in out):
        out.append(f"hydra.searchpath=[file://{_ROOT}]")
    return out
