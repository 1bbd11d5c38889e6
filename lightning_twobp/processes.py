"""Running a function on several CPU processes with gloo: for tests and benchmarks.

Ranks are forked from one server process that has imported torch, Lightning and this package once (a
spawned rank spends most of a short job importing them: 3-6 s of CPU each on a 2-core machine). The server
runs no torch op and touches no GPU, so a forked rank starts as clean as a spawned one; it gets the
launching process's environment, working directory, ``sys.path``, stdout and stderr at each launch, and
fresh seeds for torch's and NumPy's global generators, as a spawned one would (forked, every rank of every
launch drew the same unseeded numbers, and wrote where the launcher's output went when the server started).
Every rank gets one intra-op thread, a fresh free port (also in its MASTER_ADDR and MASTER_PORT), and a
hard timeout: a rank that fails or hangs stops the whole group and the parent raises with the rank's
traceback, never waits forever. A port another process takes between :func:`free_port` and rank 0's bind
(jobs run side by side) makes a new launch on a new port, up to three, rather than an error.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "rank_env", "run_distributed"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> None:
    """Set what Lightning's launcher would set for ``rank``, so that a Trainer inside a function that
    :func:`run_distributed` runs joins the processes it started (Lightning then launches nothing)."""
    values = {"LOCAL_RANK": rank, "RANK": rank, "NODE_RANK": 0, "WORLD_SIZE": world, "MASTER_PORT": port}
    os.environ.update({k: str(v) for k, v in values.items()}, MASTER_ADDR="127.0.0.1")


# Imported once, by the server the ranks are forked from (see the module's docstring).
_PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "lightning_twobp"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts: the first launch of this process
    return ctx


class _Stdio:
    """The launcher's stdout and stderr of the moment, handed to a rank (the server's are those of its start,
    before a test's capture or a script's redirection): file descriptors passed as ``multiprocessing`` passes
    them, taken over when the rank unpickles its arguments."""

    def __reduce__(self) -> tuple[Any, tuple[Any, Any]]:
        from multiprocessing import reduction

        return _adopt_stdio, (reduction.DupFd(1), reduction.DupFd(2))


def _adopt_stdio(out: Any, err: Any) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, target in ((out, 1), (err, 2)):
        new = fd.detach()
        os.dup2(new, target)
        os.close(new)


def _fresh_seeds() -> None:
    """Seeds a spawned rank would have: its own, not the server's, which every forked rank would share."""
    torch.seed()
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed()


def _worker(
    rank: int,
    world: int,
    port: int,
    fn: Callable,
    args: tuple,
    queue: Any,
    threads: int,
    timeout: float,
    backend: str,
    env: dict[str, str],
    stdio: None,  # _Stdio: taken over already, on unpickling
) -> None:
    # The server's environment is the one it started with; a spawned rank would have the launcher's now
    # (a test's monkeypatched variable, a port exported since).
    os.environ.clear()
    os.environ.update(env)
    _fresh_seeds()
    torch.set_num_threads(threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # The group's address, for code that reads it as torchrun sets it (Lightning's environment).
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # NCCL: GPU ``rank`` is this rank's, set before the group is made and bound to it (as Lightning does)
    device = torch.device("cuda", rank) if backend == "nccl" else None
    try:
        if device is not None:
            torch.cuda.set_device(device)
        try:
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=timeout),
                device_id=device,
            )
        except dist.DistNetworkError as e:
            if "EADDRINUSE" not in str(e):
                raise
            # another process took the port between free_port and the bind: nothing ran, launch again
            queue.put((rank, "port", str(e)))
            return
        try:
            # Pickled here, not by the queue: torch's queue reducers share tensors through file
            # descriptors that die with this process, which exits right after.
            queue.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report every failure, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    threads: int = 1,
    grace: float = 5.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return the results by
    rank. ``fn`` must be importable (defined at module level). Raises if any rank fails or the group
    does not finish within ``timeout`` seconds. After a rank fails, the others have ``grace`` seconds
    (at least 10 after one dies without a report) to report theirs before they are stopped. ``backend``:
    gloo (CPU), or ``"nccl"`` with GPU ``r`` for rank ``r``."""
    for _ in range(_PORT_TRIES - 1):
        try:
            return _launch(fn, world_size, args, timeout, threads, grace, backend)
        except _PortTaken:
            continue
    try:
        return _launch(fn, world_size, args, timeout, threads, grace, backend)
    except _PortTaken as e:
        raise RuntimeError(
            f"rank 0 could not bind a free port for the rendezvous in {_PORT_TRIES} launches: another process took "
            f"each one between its choice and the bind (many jobs starting at once on this machine); run again, or "
            f"fewer jobs at a time. The last: {e}"
        ) from e


_PORT_TRIES = 3  # launches when the rendezvous port is taken before rank 0 binds it (concurrent jobs)


class _PortTaken(Exception):
    """Rank 0 could not bind the rendezvous port: another process took it after :func:`free_port`."""


def _launch(
    fn: Callable[..., Any], world_size: int, args: tuple, timeout: float, threads: int, grace: float, backend: str
) -> list[Any]:
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, args, queue, threads, timeout, backend, env, _Stdio()),
            daemon=False,  # a rank may start processes of its own: a DataLoader's workers
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(results) + len(errors) < world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0 and errors:
                break
            if left <= 0:
                raise TimeoutError(
                    f"distributed run of {fn.__name__} on {world_size} ranks did not finish in {timeout:.0f} s; "
                    f"finished ranks: {sorted(results)}"
                )
            try:
                rank, status, value = queue.get(timeout=min(left, 1.0))
            except Exception:
                for i, proc in enumerate(procs):
                    if proc.exitcode not in (None, 0) and i not in results and f"--- rank {i} " not in "".join(errors):
                        # Died without a report (killed): give the others a few seconds to say what they
                        # saw of it, then stop them.
                        errors.append(f"--- rank {i} died without a report, exit code {proc.exitcode} ---")
                        deadline = min(deadline, datetime.datetime.now() + datetime.timedelta(seconds=max(grace, 10)))
                continue
            if status == "ok":
                results[rank] = pickle.loads(value)
            elif status == "port" and not results:
                raise _PortTaken(value)
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
                # The others may be blocked on the failed rank: give them a few seconds to report
                # their side (often "connection closed"), then stop them.
                deadline = min(deadline, datetime.datetime.now() + datetime.timedelta(seconds=grace))
    finally:  # every rank stopped (killed where it waits on a failed one, or on a port another process took)
        for p in procs:
            p.join(timeout=0 if errors or len(results) < world_size else 10)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        errors.sort()
        raise RuntimeError("a rank failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
