"""Preemption: SIGTERM (a scheduler's notice) or SLURM's requeue signal stops every rank at the same step.

Lightning's own SIGTERM handler runs a broadcast inside the handler, a collective the other ranks do not
join while they are in the middle of a pipeline step, and its per-step check reads rank 0's flag only: a
signal to every rank mid-step, or to one rank, hangs until a timeout or trains on. For the length of
training :class:`StopSignals` replaces it with a handler that only notes the signal. The ranks agree on
it at step boundaries: each training step starts a one-number-per-rank all-reduce on a CPU group of its
own before its pipeline step and reads it at its end. Every rank started that reduce before the step's
messages, so it has finished by then: nothing on the hot path waits for it and no accelerator is
synchronised. Once they agree, each rank keeps the training loader's position as it is at that step's
end, before Lightning takes the next batch, for the checkpoint saved at the stop.

Once a rank sees a signal every rank raises :class:`Preempted` before the same training step: Lightning's
``on_exception`` hooks then run at one step boundary on every rank alike, so
``ModelCheckpoint(save_on_exception=True)`` writes a complete checkpoint; without it the last checkpoint
stays as it was. A signal during a save lets the save finish (it is atomic: a hidden ``.partial``
directory renamed into place). The process exits with ``128 + signal`` (143 for SIGTERM), never 0.
SLURM's requeue signal (``SLURMEnvironment(auto_requeue=True)``, SIGUSR1 by default) does what Lightning
does for it, but at the agreed step on every rank: save the HPC checkpoint, requeue (rank 0), then stop.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException

__all__ = ["Preempted", "StopSignals", "exit_after_launcher", "mark_launcher", "take_launcher_mark"]

log = logging.getLogger(__name__)


class Preempted(SIGTERMException):
    """Every rank stopped before the same training step because a rank received SIGTERM or SLURM's
    requeue signal; the exit status is ``128 + signal``."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.message = message
        self.code = 128 + signum  # SystemExit's exit status

    def __str__(self) -> str:
        return self.message


_LAUNCHER = "TWOBP_LAUNCHER_PID"  # set by the process whose Lightning launcher starts the other ranks
_launcher_pid: str | None = None  # in a rank that launcher started: its pid (taken out of the environment)


def mark_launcher() -> None:
    """In the process that is about to start the other ranks (Lightning's launcher, rank 0): say so to
    them (an environment variable they inherit), for :func:`exit_after_launcher`."""
    os.environ[_LAUNCHER] = str(os.getpid())


def take_launcher_mark() -> None:
    """In a rank that starts no others: keep the launcher's mark here and out of the environment, so that
    processes this rank starts (a nested run) do not take this rank for their launcher."""
    global _launcher_pid
    _launcher_pid = os.environ.pop(_LAUNCHER, None) or _launcher_pid


def exit_after_launcher(wait: float = 120.0) -> None:
    """On a rank Lightning's launcher started, stopped by :class:`Preempted`: end the process after the
    launcher's, not before (up to ``wait`` seconds: a logger's upload at exit may take a while). The
    launcher's observer thread checks its ranks every 5 s and SIGKILLs the whole job (exit status -9, not
    ``128 + signal``) when it finds one ended with a non-zero status while the launcher still runs, as the
    launcher does for a moment after every rank stopped at the same step. Elsewhere (torchrun, SLURM,
    another parent) nothing waits."""
    parent = os.getppid()
    if _launcher_pid != str(parent):
        return

    def after_parent() -> None:
        deadline = time.monotonic() + wait
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(0.05)

    atexit.register(after_parent)


def _requeue_signal(trainer: Any) -> int | None:
    """The signal Lightning requeues a SLURM job on, where it does (auto_requeue), else None."""
    env = getattr(trainer.strategy, "cluster_environment", None)  # the environment Lightning chose
    if isinstance(env, SLURMEnvironment) and env.auto_requeue:
        return int(env.requeue_signal or signal.SIGUSR1)
    return None


class StopSignals:
    """The signals that stop training, noted by a handler and agreed on by every rank at step boundaries."""

    def __init__(self, timeout: timedelta) -> None:
        self._group = None
        self._world, self._rank = 1, 0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # gloo even under NCCL: the flags stay on the host, so reading them never syncs a device.
            self._group = dist.new_group(backend="gloo", timeout=timeout)
            self._world, self._rank = dist.get_world_size(), dist.get_rank()
        self._trainer: Any = None
        self._replaced: dict[int, Any] = {}
        self._signum = 0  # the first signal this rank received, 0: none
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._agreed: torch.Tensor | None = None  # the flags of a stop read at a step's end, raised at the next
        # The training loader's position at the end of the last step trained, once a stop is agreed: what a
        # checkpoint saved for the stop holds (Lightning takes the next batch before the step that raises).
        self.loader_states: Any = None

    # ------------------------------------------------------------------ the handler
    def install(self, trainer: Any) -> None:
        """Replace the handlers of SIGTERM (and the requeue signal) for the length of training. Called
        after Lightning registered its own, which this undoes until :meth:`uninstall`."""
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only; leave Lightning's handling
        self._trainer, self._signum, self._pending = trainer, 0, None
        self._agreed, self.loader_states = None, None
        signals = {int(signal.SIGTERM)}
        requeue = _requeue_signal(trainer)
        if requeue is not None:
            signals.add(requeue)
        for signum in signals:
            self._replaced[signum] = signal.signal(signum, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        """Only note it: no collective, no I/O, nothing that could wait on another rank."""
        if self._signum:
            return
        self._signum = signum
        self._received = time.monotonic()
        launcher = getattr(self._trainer.strategy, "launcher", None)
        if launcher is not None:  # Lightning's launcher passes the signal on to the ranks it started
            launcher.kill(signum)

    def uninstall(self) -> None:
        """Put back the handlers replaced, where nobody replaced ours since."""
        for signum, old in self._replaced.items():
            if signal.getsignal(signum) == self._note:
                signal.signal(signum, old)
        self._replaced = {}

    # ------------------------------------------------------------------ agreement
    def agree(self, step: int) -> None:
        """At the start of training step ``step`` on every rank: read what the previous step's reduce
        says (or :meth:`settle` read), raise :class:`Preempted` if any rank was signalled, else start this
        step's reduce."""
        if not self._replaced:
            return
        seen = self._agreed if self._agreed is not None else self._read()
        if seen is not None:
            self._stop(seen, step)
        flags = torch.zeros(self._world, dtype=torch.int64)
        flags[self._rank] = self._signum
        if self._group is None:
            self._pending = (None, flags)
        else:
            self._pending = (dist.all_reduce(flags, group=self._group, async_op=True), flags)

    def settle(self, loader_states: Callable[[], Any]) -> None:
        """At the end of a training step on every rank: read this step's reduce (every rank started it
        before the step, so it has finished) and, where it says stop, keep ``loader_states()``, the
        training loader's position now. Lightning takes the next batch before the step at whose start
        every rank stops; a checkpoint saved for the stop holding the position after that batch made
        the resumed run skip it. :meth:`agree` raises at the next step's start, as before."""
        if not self._replaced or self._agreed is not None:
            return
        self._agreed = self._read()
        if self._agreed is not None:
            self.loader_states = loader_states()

    def close(self) -> None:
        """Training ended: wait for the last reduce, so that no collective of ours stays in flight."""
        self._read()

    def _read(self) -> torch.Tensor | None:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        work, flags = pending
        if work is not None:
            work.wait()  # finished during the step in between
        return flags if bool(flags.any()) else None

    def _stop(self, flags: torch.Tensor, step: int) -> None:
        ranks = [r for r, s in enumerate(flags.tolist()) if s]
        signum = int(flags[ranks[0]])
        name = signal.Signals(signum).name
        took = f" {time.monotonic() - self._received:.1f} s after it arrived here," if self._signum else ""
        message = (
            f"twobp: {name} on rank(s) {ranks}: every rank stopped before training step {step},{took} at the "
            f"same step boundary (ModelCheckpoint(save_on_exception=True) saves a checkpoint there; otherwise "
            f"the last one is left as it was); exit status {128 + signum}"
        )
        log.warning(message)
        requeue = _requeue_signal(self._trainer)
        if signum == requeue and signum != signal.SIGTERM:
            # Lightning's own requeue, run where every rank is at one step (its handler would run it
            # inside the signal handler): the HPC checkpoint, saved by every rank, then scontrol requeue
            # on rank 0. Lightning's private handler, used here only.
            self._trainer._signal_connector._slurm_sigusr_handler_fn(signum, None)
        raise Preempted(message, signum)
