"""The generators a model's modules hold of their own, kept and put back.

A module may draw from a ``torch.Generator`` of its own (torchtune's ``LayerDropout`` keeps one per layer), which
forking torch's global generators leaves alone: a forward run for shapes, a call-order trace or a profile drew
from it, and training then drew other masks than one process (a trial: every weight 1-2% off).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

__all__ = ["keep_generators"]


def keep_generators(modules: Iterable[nn.Module]) -> Callable[[], None]:
    """The state of every ``torch.Generator`` that ``modules`` hold as plain attributes, and the call that puts it
    back."""
    saved = [(g, g.get_state()) for m in modules for g in vars(m).values() if isinstance(g, torch.Generator)]

    def put_back() -> None:
        for g, state in saved:
            g.set_state(state)

    return put_back
