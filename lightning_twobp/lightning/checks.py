"""Refusals before any compute that need no pipeline: options of the wrong type, a launch that cannot
start, optimizers the pipeline cannot step. Each error names the value and the fix
(docs/troubleshooting.md keeps a row per error)."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["check_flag", "check_nodes"]

_LOOPBACK = ("", "127.0.0.1", "localhost", "::1")


def check_flag(name: str, value: Any, none: str | None = None) -> None:
    """``value`` is a bool (or ``None`` where ``none`` says what ``None`` means). A string is refused:
    ``"false"`` and ``"no"`` are truthy, so ``if value:`` would take them as true."""
    if isinstance(value, bool) or (value is None and none is not None):
        return
    allowed = "True or False" + (f", or None ({none})" if none is not None else "")
    raise ValueError(
        f"TwoBPStrategy({name}={value!r}): it must be {allowed}, not a {type(value).__name__}; pass a bool "
        f"(e.g. {name}=False). On the command line Hydra and LightningCLI read true/false as booleans: "
        f"strategy.{name}=false"
    )


def check_nodes(num_nodes: int, devices: int, environment: Any) -> None:
    """``num_nodes > 1`` while Lightning launches the processes on this machine and nothing says which node
    this is: the ranks started here would wait for the other nodes' ranks, which nobody starts (a hang
    until the process group's timeout). Refused before anything is launched."""
    if num_nodes <= 1 or environment is None or environment.creates_processes_externally:
        return
    if os.environ.get("NODE_RANK") or os.environ.get("GROUP_RANK"):
        return  # a multi-node run started by hand on each node
    address = os.environ.get("MASTER_ADDR", "")
    if address not in _LOOPBACK:
        return
    raise ValueError(
        f"Trainer(num_nodes={num_nodes}, devices={devices}) on one machine: Lightning starts {devices} process(es) "
        f"here and they would wait for {(num_nodes - 1) * devices} more from {num_nodes - 1} other node(s) that "
        f"nothing starts (NODE_RANK is not set, MASTER_ADDR={address or 'unset'}). On one machine use num_nodes=1 "
        f"with devices={num_nodes * devices}; across machines run the same command on each node with "
        f"NODE_RANK=0..{num_nodes - 1} and MASTER_ADDR=<node 0's address>, or launch with torchrun or srun"
    )
