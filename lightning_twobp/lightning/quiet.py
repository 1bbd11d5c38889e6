"""Two deprecation warnings every run printed before its first step, from our dependencies, not from
anything the user can change: torchdata's ``StatefulDataLoader`` calls ``torch.set_vital`` (deprecated
in torch 2.13), and Lightning's ``CombinedLoader`` builds a pytree ``LeafSpec`` (deprecated likewise).
:func:`known_warnings_off` silences exactly those (message, category and the module that warns), for
the length of a Trainer call; every other warning, theirs included, still shows.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["KNOWN_WARNINGS", "known_warnings_off"]

# (message regex, category, regex of the module the warning is attributed to)
KNOWN_WARNINGS = [
    (r"'set_vital' is deprecated", UserWarning, r"torchdata\."),
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"lightning\.pytorch\.utilities\._pytree"),
]


@contextmanager
def known_warnings_off() -> Iterator[None]:
    """Inside: :data:`KNOWN_WARNINGS` are ignored. The filters before are back after (``catch_warnings``)."""
    with warnings.catch_warnings():
        for message, category, module in KNOWN_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category, module=module)
        yield
