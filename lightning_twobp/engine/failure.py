"""The first failure, told to every rank: when one rank fails, the others end naming it.

A rank whose step raises (an error in the user's code, torch refusing reentrant checkpointing, an
action of the schedule, or the first to find a peer killed or hung) writes a one-line summary of it
(rank, stage, step, cause) into the process group's own key-value store before it raises; the first
writer wins (``compare_set``). Its peers are waiting on it for a message: when its process ends their
wait fails (the connection closes), and instead of "peer was lost" each raises :class:`PeerFailed`
with that summary. Nothing happens on the happy path but one mark per rank at a Trainer call's end: the
store is read only after a wait on a peer failed.

The store is served by global rank 0's process and ends with it: after a failure, rank 0 waits (a few
seconds at most) until every other rank is done with the store (:meth:`FailureChannel.leave`), so that a
peer slow to read the failure rank 0 told finds it there, not a closed store.

A failed rank whose process lives on (the user's script caught the error and goes on, to save, log or
evaluate) would leave its peers waiting on it until the timeout: :func:`close_links` closes its
connections once it has told, so that their waits fail now (gloo groups; see there).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import os
import re
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from lightning_twobp.engine.executor import PipelineError
from lightning_twobp.engine.p2p import CLOSED, PeerLost
from lightning_twobp.private import process_groups

__all__ = ["FailureChannel", "PeerFailed", "check_links_open", "close_links", "lost_peer", "process_state"]

log = logging.getLogger(__name__)

_LOST = ("Connection closed", "Connection reset", "closed by peer", "Broken pipe", "Timed out", "timed out")
_STORE_WAIT = 3.0  # seconds a store call may take before the store counts as gone
_CALLS = itertools.count()  # one key per Trainer call, the same on every rank (they build in one order)
# A tag no message of ours uses (engine/p2p.py's grow from 0 with the micro-batch): close_links' receive
# must wait, not take a message in flight.
_NEVER_SENT = 2**31 - 97
_CLOSED: str | None = None  # why close_links closed this process's groups (check_links_open)
_RESOLVED = "_twobp_resolved"  # set on what FailureChannel.resolve returned


class PeerFailed(PipelineError):
    """Another rank failed first; the message holds its summary (its own log has the traceback)."""


def lost_peer(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a wait on another rank that failed: a lost connection or
    a timeout, not an error of this rank's own."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, PeerLost) or any(k in str(e) for k in _LOST):  # DCP's errors hold the text too
            return True
        e = e.__cause__ or e.__context__
    return False


_SAID = 2000  # characters of the first failure's message the other ranks are told (a refusal's first line whole)


def _cause(error: BaseException) -> str:
    """The innermost cause, as ``Type: first line``."""
    root = error
    while root.__cause__ is not None and not isinstance(root, PeerLost):  # PeerLost names the rank; gloo not
        root = root.__cause__
    lines = str(root).strip().splitlines()
    said = f"{type(root).__name__}: {lines[0] if lines else ''}"
    if len(said) <= _SAID:
        return said
    # our refusals name the fix at the end of a long first line: keep most of it, cut between words if one is near
    cut = said[:_SAID].rsplit(" ", 1)[0]
    return (cut if len(cut) > _SAID // 2 else said[:_SAID]) + " [...]"


def close_links(reason: str, groups: list[Any] | None = None) -> int:
    """Close this rank's connections in every gloo process group it is in (``groups``: all it holds), so that
    the peers waiting on it fail at once (``Connection closed``) and read the failure it told, instead of
    waiting until the group's timeout. Returns how many groups were closed; ``reason`` (the first failure)
    is what :func:`check_links_open` names afterwards.

    gloo has no abort (``ProcessGroup.abort`` does nothing there): a receive whose wait times out puts every
    connection of its group into the error state and closes it, which is what this uses (a receive on a
    tag never sent, waited on for a millisecond); tests/test_failure.py checks it on the installed torch.
    A peer already gone fails the receive at once, and the next one is tried. NCCL groups are left to
    NCCL's own watchdog (``pipeline_timeout``). The groups cannot carry messages afterwards: only for a
    run that failed in its middle, where they could carry none in step anyway. Never raises: it runs
    while an error is on its way to the user, which it must not replace."""
    global _CLOSED
    closed = 0
    for group in process_groups() if groups is None else groups:
        try:
            if "gloo" in str(dist.get_backend(group)) and dist.get_world_size(group) > 1 and _close(group):
                closed += 1
        except Exception as err:  # noqa: BLE001 - see the docstring
            log.debug("twobp: could not close a process group's links: %s", err)
    if closed:
        _CLOSED = reason or "a step that failed part-way"
    return closed


def _close(group: Any) -> bool:
    """Whether ``group`` is closed now: by this receive's timeout, or already (a peer's connection gone)."""
    me, size = dist.get_rank(group), dist.get_world_size(group)
    closed = False
    for k in range(1, size):
        peer = dist.get_global_rank(group, (me + k) % size)
        try:
            work = dist.irecv(torch.empty(1), src=peer, group=group, tag=_NEVER_SENT)
            if work is not None:  # None only where this rank is not in the group (not in process_groups)
                work.wait(datetime.timedelta(milliseconds=1))
        except RuntimeError as err:
            if "Timed out" in str(err):
                return True
            closed = True  # that peer's connection is closed already: the others may not be, try them
    return closed


def check_links_open(what: str) -> None:
    """Raise, naming the fix, where :func:`close_links` closed this process's groups: ``what`` (a new
    Trainer call, a save) would otherwise meet gloo's "Application timeout caused pair closure"."""
    if _CLOSED is not None:
        raise RuntimeError(
            f"twobp: {what} cannot run in this process: its gloo process groups were closed after a step failed "
            f"part-way ({_CLOSED}), so that the other ranks would not wait on it. Start new processes to go on "
            f"(resume from the last checkpoint: trainer.fit(model, ckpt_path='last'))."
        )


def process_state(pid: int) -> str | None:
    """``"dead"``, ``"stopped"`` or None (running, or not knowable here) for a process of this host."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "dead"
    except OSError:
        return None
    return {"Z": "dead", "X": "dead", "T": "stopped (SIGSTOP?)", "t": "stopped (traced)"}.get(state)


def _default_store() -> Any:
    """The default process group's key-value store. torch has no public accessor; this is the one place
    that uses the private one (tests/test_failure.py fails loudly if it goes)."""
    return dist.distributed_c10d._get_default_store()


class FailureChannel:
    """One Trainer call's failure key in the process group's store. ``me`` names this rank."""

    def __init__(self, store: Any, me: str) -> None:
        self._store = store
        self._key = f"twobp/failure/{next(_CALLS)}"
        self._me = me
        self.seen = False  # this rank raised a failure, its own or a peer's, in this Trainer call
        self._world = dist.get_world_size() if dist.is_initialized() else 1
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._marked = False  # this rank's mark in the roll of ranks that raised (see everyone_failed)
        self._gone = False  # the store stopped answering (it lives in global rank 0's process)
        self._done = False  # this rank's mark: done with the store in this Trainer call (see leave)
        self._publish()

    @property
    def me(self) -> str:
        return self._me

    @me.setter
    def me(self, me: str) -> None:
        """A fuller name once it is known (its pipeline rank and stages, after the pipeline is built)."""
        self._me = me
        self._publish()

    def _publish(self) -> None:
        """Where this rank runs and what it is called, for the others' :meth:`roll_call`."""
        if dist.is_initialized():
            record = f"{socket.gethostname()} {os.getpid()} {self._me}"
            self._store.set(f"{self._key}/pid/{dist.get_rank()}", record)

    @classmethod
    def open(cls, me: str) -> FailureChannel | None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        return cls(_default_store(), me)

    def report(self, error: BaseException, where: str) -> None:
        """Tell the other ranks that this one failed, unless a failure was told before."""
        summary = f"{self.me} failed at {where}: {_cause(error)}"
        try:
            self._ask("compare_set", self._key, "", summary)
        except Exception as err:  # noqa: BLE001 - the store itself may be gone; the error still raises
            log.debug("twobp: could not report the failure: %s", err)

    def _ask(self, method: str, *args: Any) -> Any:
        """A store call bounded by a few seconds: the store is served by global rank 0's process, which
        may be the one stopped or hung. A call that does not return leaves the store to its thread and
        this channel mute (a second call on that connection would read the first one's answer)."""
        if self._gone:
            raise RuntimeError("the store did not answer before")
        out: dict[str, Any] = {}

        def call() -> None:
            try:
                out["value"] = getattr(self._store, method)(*args)
            except Exception as err:  # noqa: BLE001 - handed to the caller
                out["error"] = err

        thread = threading.Thread(target=call, daemon=True, name="twobp-failure-store")
        thread.start()
        thread.join(_STORE_WAIT)
        if thread.is_alive():
            self._gone = True
            raise RuntimeError(f"the store did not answer in {_STORE_WAIT:g} s (global rank 0 hung or stopped?)")
        if "error" in out:
            raise out["error"]
        return out.get("value")

    def roll_call(self) -> str:
        """The ranks on this host whose process is gone or stopped, by the name each gave itself, as
        ``global rank 1 (pipeline rank 1, stage(s) 1, host a), pid 42 (dead)``; empty when none is (or
        they run on other hosts, where no process can be looked at)."""
        here, found = socket.gethostname(), []
        for r in range(self._world):
            try:
                if not self._ask("check", [f"{self._key}/pid/{r}"]):
                    continue
                host, pid, name = self._ask("get", f"{self._key}/pid/{r}").decode().split(" ", 2)
            except Exception:  # noqa: BLE001 - the store went away with rank 0
                break
            state = process_state(int(pid)) if host == here else None
            if state is not None:
                found.append(f"{name}, pid {pid} ({state})")
        return "; ".join(found)

    def _present(self, keys: list[str], wait: float) -> bool:
        """Whether every one of ``keys`` is in the store, waiting up to ``wait`` seconds for them (False where
        the store went away with rank 0)."""
        deadline = time.monotonic() + wait
        while True:
            try:
                if self._ask("check", keys):
                    return True
            except Exception:  # noqa: BLE001 - a store that went away with rank 0: nothing there
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def first(self, wait: float) -> str | None:
        """The first failure told, waiting up to ``wait`` seconds for one."""
        if not self._present([self._key], wait):
            return None
        try:
            return self._ask("get", self._key).decode()
        except Exception:  # noqa: BLE001 - a store that went away with rank 0: nothing to name
            return None

    def mark_failed(self) -> None:
        """Put this rank on the roll of ranks that raised in this Trainer call (once)."""
        if self._marked:
            return
        self._marked = True
        try:
            self._ask("set", f"{self._key}/failed/{self._rank}", "1")
        except Exception as err:  # noqa: BLE001 - the store may be gone: then nobody is known to have failed
            log.debug("twobp: could not mark this rank failed: %s", err)

    def done(self) -> None:
        """Mark this rank done with the store in this Trainer call (once): at its end, failed or not."""
        if self._done:
            return
        self._done = True
        try:
            self._ask("set", f"{self._key}/left/{self._rank}", "1")
        except Exception as err:  # noqa: BLE001 - the store may be gone: nobody can read it then
            log.debug("twobp: could not mark this rank done with the store: %s", err)

    def leave(self, wait: float) -> None:
        """This rank is done with the store in this Trainer call (its failure resolved, told and its links
        closed). The store is served by global rank 0's process and ends with it: there, wait up to ``wait``
        seconds until every other rank is done with it too (or its process, on this host, is dead or
        stopped). A rank 0 that failed first and whose process then ended at once left a peer still on its
        way to the store (a loaded machine) with no store to read the failure from, and it said rank 0 "died
        or was killed"."""
        self.done()
        if self._rank != 0:
            return
        deadline = time.monotonic() + wait
        waiting = list(range(1, self._world))
        while waiting:
            waiting = [r for r in waiting if not self._left(r)]
            if not waiting or time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _left(self, rank: int) -> bool:
        """Whether global rank ``rank`` needs the store no more: done with it, or its process dead or stopped."""
        try:
            if self._ask("check", [f"{self._key}/left/{rank}"]):
                return True
            if not self._ask("check", [f"{self._key}/pid/{rank}"]):
                return False
            host, pid, _ = self._ask("get", f"{self._key}/pid/{rank}").decode().split(" ", 2)
        except Exception:  # noqa: BLE001 - the store stopped answering: nothing to keep it for
            return True
        return host == socket.gethostname() and process_state(int(pid)) is not None

    def everyone_failed(self, wait: float) -> bool:
        """Whether every rank raised in this Trainer call (an error they all meet, as a check at the same
        point of a step), waiting up to ``wait`` seconds for the others to: then no rank waits on another,
        and the groups are left usable (see :func:`close_links`)."""
        return self._present([f"{self._key}/failed/{r}" for r in range(self._world)], wait)

    def _raised(self, loss: str) -> bool:
        """Whether the peers a loss names (``... global rank 2, host a) stopped answering``) all raised in this
        Trainer call: each marks itself on the roll before its links close. A peer killed meanwhile (3+ ranks:
        the first failure told was another rank's) is not, and its loss keeps its words."""
        ranks = re.findall(r"global rank (\d+)", loss.rsplit(" stopped answering ", 1)[0])
        if not ranks:  # not named by rank: said as before
            return True
        return self._present([f"{self._key}/failed/{r}" for r in ranks], wait=1.0)

    def resolve(self, error: BaseException, where: str, relay_losses: bool = True) -> BaseException:
        """What this rank raises for ``error`` at ``where``: a lost peer becomes :class:`PeerFailed`
        naming the first failure (where one was told; with ``relay_losses`` False only where that was an
        error of a rank's own, not another rank's report of the same loss); an error of its own is told
        to the others. An error resolved already (by a ``told`` inside this one) stays as it is."""
        self.seen = True
        self.mark_failed()
        if getattr(error, _RESOLVED, False):
            return error
        resolved = self._resolved(error, where, relay_losses)
        with contextlib.suppress(AttributeError):  # a type without a __dict__: resolved again, to the same answer
            setattr(resolved, _RESOLVED, True)
        return resolved

    def _resolved(self, error: BaseException, where: str, relay_losses: bool) -> BaseException:
        if not lost_peer(error):
            self.report(error, where)
            return error
        # The failing rank told the store before its connections closed: the key is there already,
        # unless the peer was killed (nothing told, the lost-peer error stands).
        first = self.first(wait=2.0)
        if first is None:  # nobody told a failure (a rank killed or stopped): this loss is the first
            self.report(error, where)
            return error
        if first.startswith(f"{self.me} ") or (not relay_losses and f": {PeerLost.__name__}: " in first):
            return error
        lines = str(error).strip().splitlines()
        here = lines[0] if lines else type(error).__name__
        if CLOSED in here and self._raised(here.split(CLOSED, 1)[0]):
            # the lost peer raised (told the first failure, or met it): its links closed after it
            # (close_links or its end), it was not killed
            here = here.replace(CLOSED, "its connection closed after that failure")
        return PeerFailed(
            f"{self.me} stopped at {where} because {first} (the first failure; its log has the traceback). Here: {here}"
        )
