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
* :func:`reap`: under Lightning's launcher rank 0 started the other ranks, and nothing ends them when
  rank 0 fails: a stopped rank, or one waiting on it in a collective, would outlive the job.
* :func:`naming_lost`: around the collectives over every rank outside the pipeline's own waits (the
  global gradient norm, Lightning's ``sync_dist``, the stop-signal agreement): a lost rank is named
  there too, not left to gloo's "Connection closed by peer [address]:port".
* :func:`note_epoch_end`: an epoch-end hook of the user's that failed on a rank without the last stage,
  where what the steps collected is missing, is told why.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerStatus

from lightning_twobp.engine.failure import FailureChannel, lost_peer, process_state
from lightning_twobp.engine.p2p import PeerLost

__all__ = ["lost_rank", "naming_lost", "note_epoch_end", "reap", "save_refused", "told"]


@contextmanager
def told(channel: FailureChannel | None, where: str, relay_losses: bool = True) -> Iterator[None]:
    """Tell the other ranks this rank's own failure; name the first failure where a peer was lost (see
    :meth:`FailureChannel.resolve` for ``relay_losses``)."""
    try:
        yield
    except Exception as err:
        if channel is None:
            raise
        resolved = channel.resolve(err, where, relay_losses)
        if resolved is err:
            raise
        raise resolved from err


@contextmanager
def naming_lost(what: str, who: Callable[[], str]) -> Iterator[None]:
    """A collective ``what`` that fails on a lost connection or a timeout raises :class:`PeerLost`
    naming ``who()`` (asked only then: it may look around, :func:`lost_rank`)."""
    try:
        yield
    except RuntimeError as e:
        if not lost_peer(e) or isinstance(e, PeerLost):
            raise
        raise PeerLost(
            f"{who()} stopped answering while global rank {dist.get_rank()} waited for {what}: its connection "
            f"closed or the wait timed out (the process died, was killed or hung)"
        ) from e


def lost_rank(channel: FailureChannel | None, replicas: str) -> str:
    """Who is gone, for a collective over every rank: the processes of this host found dead or stopped
    (``channel``'s roll call), else this rank's data-parallel ``replicas`` (``global rank 2 (host b)``),
    which a lost node takes with it."""
    gone = _roll_call(channel)
    if gone:
        return gone
    return (
        f"a rank (a lost node takes this rank's data-parallel replicas with it: {replicas})" if replicas else "a rank"
    )


def _roll_call(channel: FailureChannel | None, tries: int = 5) -> str:
    """The channel's roll call, asked a few times over a second: a killed process's connections close
    while it exits, a moment before /proc shows it dead."""
    for _ in range(tries if channel is not None else 0):
        assert channel is not None  # tries is 0 without one
        gone = channel.roll_call()
        if gone:
            return gone
        time.sleep(0.2)
    return ""


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
        f"{type(error).__name__} was raised on this rank in a step or a hook, not at a step boundary the "
        f"strategy knows every rank shares (a preemption, a non-finite step), so the ranks may be at different "
        f"points of a step; the last checkpoint on disk is left as it was"
    )


def reap(launcher: Any, grace: float = 10.0) -> None:
    """Rank 0 failed: no rank it started may outlive it. A stopped one is killed at once, so that the
    ranks waiting on it (its data-parallel peer in a collective) see its connection close now and name
    the failure instead of waiting for the process group's timeout; the others get ``grace`` seconds to
    end with their own error, then are killed."""
    procs = [p for p in getattr(launcher, "procs", None) or [] if p.poll() is None]
    for proc in procs:
        if (process_state(proc.pid) or "").startswith("stopped"):
            proc.kill()
    deadline = time.monotonic() + grace
    for proc in procs:
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if proc.poll() is None:
            proc.kill()


# each epoch-end hook -> the step whose values it may read
_STEP_OF = {
    "on_train_epoch_end": "training_step",
    "on_validation_epoch_end": "validation_step",
    "on_test_epoch_end": "test_step",
    "on_predict_epoch_end": "predict_step",
}


def note_epoch_end(exception: BaseException, module: Any, where: str) -> None:
    """Add a note to an error raised inside one of ``module``'s epoch-end hooks on a rank that does not hold
    the last stage (``where`` names it). The steps' code after the pipelined call runs on the last stage
    only, so a list the step fills (Lightning's own pattern for epoch-end values) is empty here, and
    ``torch.stack`` / ``torch.cat`` of it fails with torch's words alone."""
    frames = (frame for frame, _ in traceback.walk_tb(exception.__traceback__))
    hook = next(
        (f.f_code.co_name for f in frames if f.f_code.co_name in _STEP_OF and f.f_locals.get("self") is module), None
    )
    if hook is None:
        return
    step = _STEP_OF[hook]
    _add_note(
        exception,
        f"twobp: this error is in {hook} on {where}, which does not hold the last pipeline stage. If the hook "
        f"reads values {step} collected into the module (a list read at the epoch's end): what the step "
        f"computes after the pipelined call exists on the last stage only, so they are missing or placeholders "
        f"here. Collect them in a torchmetrics Metric (CatMetric for the values, MeanMetric for a mean), whose "
        f"state reaches every rank of the pipeline with the step's logs, or log them in the step with self.log "
        f"(docs/troubleshooting.md)",
    )


def _add_note(exception: BaseException, note: str) -> None:
    """``exception.add_note(note)``, which Python 3.10 lacks (its ``__notes__`` list is printed from 3.11)."""
    notes = getattr(exception, "__notes__", None)
    exception.__notes__ = [*(notes or []), note]  # type: ignore[attr-defined]
