"""Where twobp-train and twobp-plan find their Hydra configs.

``conf/`` holds the composable groups (model, data, trainer, strategy, schedule, callbacks, logger)
and, as the group ``recipe``, the complete named runs of the repository's ``recipes/`` (``conf/recipe``
links there). A regular install ships them inside the package as ``lightning_twobp/configs/``
(see setup.py); a source checkout (``pip install -e .``) reads ``conf/`` itself.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CONF_DIR", "recipes"]

_PACKAGED = Path(__file__).resolve().parent / "configs"
CONF_DIR = (
    Path(os.environ["TWOBP_CONF_DIR"])
    if "TWOBP_CONF_DIR" in os.environ
    else (_PACKAGED if _PACKAGED.is_dir() else Path(__file__).resolve().parent.parent / "conf")
)


def recipes() -> list[str]:
    """The names ``recipe=`` takes."""
    return sorted(p.stem for p in (CONF_DIR / "recipe").glob("*.yaml"))
