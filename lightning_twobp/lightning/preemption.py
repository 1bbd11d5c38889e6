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

An evaluation call (validate, test, predict) agrees likewise, per batch, over the world: its data-parallel
replicas wait on each other in it (the sharded stages' all-gathers in each batch, the reduce of the logged
values at its end), so a pipeline that stopped alone left them waiting on it. Replicas may read different
numbers of evaluation batches: the call's start tells every rank each replica's count per loader, and a
replica with fewer joins the reduces of the batches it lacks after its last one (where a count is unknown,
an iterable loader's, each pipeline agrees on its own, as before). The handler replaces Lightning's from
the start of fit's sanity check or of that call.

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
    """The signals that stop training, noted by a handler and agreed on by every rank at step boundaries;
    in an evaluation call (validate, test, predict) at batch boundaries (:meth:`plan_evaluation`).

    ``pipelines``: the global ranks of every pipeline (every rank creates every group, in one order): an
    evaluation call whose loaders' lengths some rank does not know agrees within each pipeline."""

    def __init__(self, timeout: timedelta, pipelines: list[list[int]] | None = None) -> None:
        # (group, the global rank of each position in it): "world", and this rank's "pipeline"
        self._groups: dict[str, tuple[Any, list[int]]] = {"world": (None, [0]), "pipeline": (None, [0])}
        self._rank = 0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # gloo even under NCCL: the flags stay on the host, so reading them never syncs a device.
            world, self._rank = list(range(dist.get_world_size())), dist.get_rank()
            self._groups["world"] = self._groups["pipeline"] = (
                dist.new_group(backend="gloo", timeout=timeout),
                world,
            )
            for ranks in pipelines if pipelines is not None and len(pipelines) > 1 else []:
                group = dist.new_group(ranks, backend="gloo", timeout=timeout)
                if self._rank in ranks:
                    self._groups["pipeline"] = (group, ranks)
        self._evaluation: _EvaluationPlan | None = None  # an evaluation call's agreement over the world
        self._trainer: Any = None
        self._replaced: dict[int, Any] = {}
        self._signum = 0  # the first signal this rank received, 0: none
        self._pending: tuple[Any, torch.Tensor, list[int]] | None = None
        self._agreed: tuple[torch.Tensor, list[int]] | None = None  # a stop read at a step's end, raised at the next
        # The training loader's position at the end of the last step trained, once a stop is agreed: what a
        # checkpoint saved for the stop holds (Lightning takes the next batch before the step that raises).
        self.loader_states: Any = None

    # ------------------------------------------------------------------ the handler
    def install(self, trainer: Any) -> None:
        """Replace the handlers of SIGTERM (and the requeue signal) for the rest of the Trainer call: from
        the start of training, or of evaluation where that comes first (fit's sanity check, validate,
        test, predict). Called after Lightning registered its own, which this undoes until
        :meth:`uninstall`; a second call keeps what the first noted."""
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only; leave Lightning's handling
        if self._replaced:
            return
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
    def agree(self, where: str, among: str = "world") -> None:
        """At the start of a step on every rank of ``among`` ("world", or this "pipeline"), ``where`` naming
        it ("training step 5", "validation batch 3"): read what the previous step's reduce says (or
        :meth:`settle` read), raise :class:`Preempted` if any rank was signalled, else start this step's
        reduce."""
        if not self._replaced:
            return
        seen = self._agreed if self._agreed is not None else self._read()
        if seen is not None:
            self._stop(*seen, where)
        group, members = self._groups[among]
        flags = torch.zeros(len(members), dtype=torch.int64)
        flags[members.index(self._rank)] = self._signum
        work = dist.all_reduce(flags, group=group, async_op=True) if group is not None else None
        self._pending = (work, flags, members)

    def plan_evaluation(self, counts: list[float] | None) -> None:
        """At an evaluation call's start, on every rank (a blocking collective over the world, where there
        are several pipelines): ``counts``, this rank's batches per loader (None: unknown). Where every rank
        knows its counts, the call agrees over the world (:meth:`agree_batch`); else within each pipeline."""
        self._evaluation = None
        group, members = self._groups["world"]
        if not self._replaced or group is None or self._groups["pipeline"][1] == members:
            return  # one pipeline: every rank of it reads as many batches (loaders.check_same_batch)
        every: list[Any] = [None] * len(members)
        dist.all_gather_object(every, counts, group=group)
        known = all(c is not None and len(c) == len(every[0]) and all(n < float("inf") for n in c) for c in every)
        if known:
            self._evaluation = _EvaluationPlan(
                own=[int(n) for n in every[members.index(self._rank)]],
                most=[int(max(n)) for n in zip(*every, strict=True)],
            )

    def agree_batch(self, kind: str, loader: int, index: int | None) -> None:
        """Before batch ``index`` of evaluation loader ``loader`` (``kind``: validation, test, predict) on every
        rank that reads it: :meth:`agree` over the world, after joining the reduces of the batches other
        replicas read and this one lacks (the end of an earlier loader's); within the pipeline where
        :meth:`plan_evaluation` found no counts, or the step takes no batch index (a ``dataloader_iter``)."""
        plan = self._evaluation
        if plan is None or index is None:
            self.agree(f"{kind} batch {index or 0}", among="pipeline")
            return
        self._pad(kind, plan.offsets[loader] + index)
        self.agree(plan.where(kind, loader, index))
        plan.position += 1

    def after_batch(self, kind: str, loader: int, index: int | None) -> None:
        """After evaluation batch ``index`` of ``loader``: where it was this rank's last of the loader, join
        the reduces of the loader's batches that other replicas still read (each waits for them to reach it),
        before Lightning reduces the loader's logged values over the replicas."""
        plan = self._evaluation
        if plan is not None and index is not None and index == plan.own[loader] - 1:
            self._pad(kind, plan.next_start(loader))

    def _pad(self, kind: str, end: int) -> None:
        plan = self._evaluation
        assert plan is not None
        while plan.position < end:
            self.agree(plan.where(kind, *plan.batch(plan.position)))
            plan.position += 1

    def settle(self, loader_states: Callable[[], Any], epoch_ended: bool, steps: bool = True) -> None:
        """At the end of a training step on every rank: read this step's reduce (every rank started it
        before the step, so it has finished) and, where it says stop, keep ``loader_states()``, the
        training loader's position now. Lightning takes the next batch before the step at whose start
        every rank stops; a checkpoint saved for the stop holding the position after that batch made
        the resumed run skip it. Where this step ended the epoch (``epoch_ended``), the stop comes after
        the next epoch's loader took its first batch: none is kept then (``[]``), so the resumed run
        starts that epoch's loader anew (this epoch's exhausted position made it skip the whole epoch).
        :meth:`agree` raises at the next step's start, as before. A batch after which the optimizer does
        not step (``steps`` False: inside a gradient-accumulation window) agrees to nothing: the window's
        gradients are in no checkpoint, so the stop waits for its last batch (a signalled rank keeps
        flagging, so the window's last reduce says it again)."""
        if not self._replaced or self._agreed is not None:
            return
        seen = self._read()
        if seen is not None and steps:
            self._agreed = seen
            self.loader_states = [] if epoch_ended else loader_states()

    def close(self, where: str | None = None) -> None:
        """Training (or an evaluation call) ended: wait for the last reduce, so that no collective of ours
        stays in flight. With ``where`` (an evaluation call's end, on every rank), agree once more, on the
        flags as they are now, and raise :class:`Preempted` if a rank was signalled: a signal in the last
        batch stopped nothing, and the next Trainer call forgot it."""
        if where is None or not self._replaced:
            self._read()
            return
        among = "world" if self._evaluation is not None else "pipeline"
        self._evaluation = None
        self.agree(where, among)  # the last batch's reduce; then one of the flags now, read at once
        seen = self._read()
        if seen is not None:
            self._stop(*seen, where)

    def _read(self) -> tuple[torch.Tensor, list[int]] | None:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        work, flags, members = pending
        if work is not None:
            work.wait()  # finished during the step in between
        return (flags, members) if bool(flags.any()) else None

    def _stop(self, flags: torch.Tensor, members: list[int], where: str) -> None:
        signalled = [(r, s) for r, s in zip(members, flags.tolist(), strict=True) if s]
        ranks, signum = [r for r, _ in signalled], signalled[0][1]
        name = signal.Signals(signum).name
        took = f" {time.monotonic() - self._received:.1f} s after it arrived here," if self._signum else ""
        message = (
            f"twobp: {name} on rank(s) {ranks}: every rank stopped before {where},{took} at the "
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


class _EvaluationPlan:
    """An evaluation call's agreement over the world: one reduce per batch of the replica that reads the most
    of each loader, in loader order. ``own``: this rank's batches per loader; ``most``: the most any rank reads."""

    def __init__(self, own: list[int], most: list[int]) -> None:
        self.own, self.most = own, most
        self.offsets = [sum(most[:i]) for i in range(len(most) + 1)]  # each loader's first reduce; the total
        self.position = 0  # the reduces this rank started

    def batch(self, position: int) -> tuple[int, int]:
        """(loader, batch index) of reduce ``position``."""
        loader = max(i for i in range(len(self.most)) if self.offsets[i] <= position)
        return loader, position - self.offsets[loader]

    def where(self, kind: str, loader: int, index: int) -> str:
        return f"{kind} batch {index}" + (f" of loader {loader}" if len(self.most) > 1 else "")

    def next_start(self, loader: int) -> int:
        """The first reduce of the next loader this rank reads batches of after ``loader`` (the total if none)."""
        later = [i for i in range(loader + 1, len(self.own)) if self.own[i]]
        return self.offsets[later[0] if later else -1]
