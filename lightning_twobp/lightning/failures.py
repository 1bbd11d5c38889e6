"""When a rank fails under ``strategy="twobp"``: the others name the first failure, and no checkpoint is
saved across ranks that are not at one step.

* :func:`told`: around each training and evaluation step. An error of this rank's own is told to the
  others through the process group's store (:class:`~lightning_twobp.engine.failure.FailureChannel`);
  a lost peer becomes :class:`~lightning_twobp.engine.failure.PeerFailed` naming the first failure.
* :func:`save_refused`: Lightning's ``on_exception`` hooks run ``ModelCheckpoint(save_on_exception=True)``
  on every rank that raised. After an error on some ranks in the middle of a step the ranks are not at
  one step boundary, so a collective save would wait on ranks that never join it (for the checkpoint
  group's 30 minutes): only what every rank raised at one boundary is saved (a preemption, a
  non-finite step). Otherwise the last checkpoint stays as it was.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.trainer.states import TrainerStatus

from lightning_twobp.engine.failure import FailureChannel

__all__ = ["save_refused", "told"]


@contextmanager
def told(channel: FailureChannel | None, where: str) -> Iterator[None]:
    """Tell the other ranks this rank's own failure; name the first failure where a peer was lost."""
    try:
        yield
    except Exception as err:
        if channel is None:
            raise
        resolved = channel.resolve(err, where)
        if resolved is err:
            raise
        raise resolved from err


def save_refused(trainer: Any, channel: FailureChannel | None, together: tuple[type, ...]) -> str | None:
    """Why a save must not run now, or None. ``together``: the exceptions every rank raises at one step
    boundary, whose checkpoint is consistent."""
    if trainer is None or trainer.state.status != TrainerStatus.INTERRUPTED:
        return None
    error = sys.exc_info()[1]  # Lightning calls on_exception inside its handler of the exception
    if error is None or isinstance(error, together):
        return None
    if channel is not None and not channel.seen:  # an error outside the step: tell the others now
        channel.report(error, f"global step {trainer.global_step}, outside the training step")
        channel.seen = True
    return (
        f"{type(error).__name__} was raised on this rank in the middle of training, not at a step boundary "
        f"every rank shares; the last checkpoint on disk is left as it was"
    )
