"""The training step's loss and logged values, from the last stage to every rank of its pipeline,
without holding the pipeline up.

They exist on the rank holding the last stage once its last forward has run. An object broadcast at
the end of the step would make every rank wait for that rank's *whole* step (its remaining B and W),
so the first stage could not start the next step early. Instead the last stage sends them the moment
its last forward is done (:meth:`LogChannel.send`, called from the loss of the last micro-batch),
with non-blocking sends of small tensors on a process group of their own (so the messages never mix
with the schedule's, which NCCL would match in posting order), and the other ranks take them at the
end of their step (:meth:`LogChannel.receive`), when they have long arrived.

A message is a header ``[values, names signature, bytes of names, stop]`` (int64) and the values
(float64: the mean loss, then each logged value, combined over the micro-batches as
:func:`~.step.step_means` does, then the step states of the torchmetrics Metrics, flattened: see
:mod:`.metrics`); the names, their ``self.log`` options and types, and the states' names, dtypes and
shapes travel as pickled bytes only when they change (the first step, a metric logged only every few
steps, a last batch of another size). Float64 holds every float32, bfloat16 and int below 2**53
exactly, so the values logged and the states merged are the last stage's. ``stop`` is the last
stage's ``trainer.should_stop`` after the step: code after the pipelined call (``self.trainer.should_stop
= True`` once the loss is low enough) runs there only, and a rank that went on alone waited for a peer
that had left the loop until the process group's timeout.
On a GPU the receiving ranks read the 4-number header on the host: one synchronisation per step
at its end, on data that arrived during the step.
"""

from __future__ import annotations

import hashlib
import math
import pickle
from typing import Any

import torch
import torch.distributed as dist

from lightning_twobp.lightning.metrics import MetricRef, States
from lightning_twobp.lightning.step import Logs

__all__ = ["LogChannel"]

_TAG_CONNECT, _TAG_HEADER, _TAG_VALUES, _TAG_NAMES = 10, 11, 12, 13


def _spec_of(means: Logs) -> list[tuple[str, dict, str]]:
    """Names, ``self.log`` options and the value's kind (python int, float, a tensor's dtype, or the
    path of a Metric)."""
    spec = []
    for name, (value, kw) in means.items():
        if isinstance(value, MetricRef):
            kind = f"metric:{value.path}"
        else:
            kind = str(value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
        spec.append((name, kw, kind))
    return spec


def _states_spec(states: States) -> list[tuple[str, str, str, tuple[int, ...]]]:
    return [(path, k, str(v.dtype), tuple(v.shape)) for path, st in states.items() for k, v in st.items()]


def _unflatten(spec: list[tuple[str, str, str, tuple[int, ...]]], flat: torch.Tensor) -> States:
    states: States = {}
    at = 0
    for path, k, dtype, shape in spec:
        n = math.prod(shape)
        states.setdefault(path, {})[k] = flat[at : at + n].reshape(shape).to(_dtype(dtype))
        at += n
    return states


def _dtype(kind: str) -> torch.dtype:
    return getattr(torch, kind.removeprefix("torch."))


def _signature(blob: bytes) -> int:
    return int(hashlib.sha1(blob).hexdigest()[:15], 16)


def _restore(value: torch.Tensor, kind: str) -> Any:
    if kind.startswith("metric:"):
        return MetricRef(kind.removeprefix("metric:"))
    if kind == "int":
        return int(value.item())
    if kind == "float":
        return float(value.item())
    return value.to(_dtype(kind))


class LogChannel:
    """One pipeline's channel from its last-stage rank (``src``, a rank in ``group``) to the others."""

    def __init__(self, group: dist.ProcessGroup, pp_rank: int, src: int, num_ranks: int, device: torch.device) -> None:
        self.group = group
        self.pp_rank = pp_rank
        self.src = src
        self.device = device
        self.peers = [r for r in range(num_ranks) if r != src]
        self._global = [dist.get_global_rank(group, r) for r in range(num_ranks)]
        self._sent_spec: int | None = None  # sender: the names signature the receivers know
        # receiver: the last names (signature, (the logged values' spec, the Metrics states' spec))
        self._spec: (
            tuple[int, tuple[list[tuple[str, dict, str]], list[tuple[str, str, str, tuple[int, ...]]]]] | None
        ) = None
        self._in_flight: list[Any] = []  # sender: works and tensors of the previous message
        self._connect()

    def _connect(self) -> None:
        """One small message from the sender to each receiver, while every rank of the pipeline builds the channel.

        NCCL connects two ranks at their first point-to-point operation, and connecting blocks the host until the
        peer posts its side. The channel's first real message goes out in the middle of a step, while the other
        ranks wait for the sender's gradients and post their receives only at the step's end: connected then, the
        sender would wait for them and they for it, until the process group's timeout. On gloo it costs one small
        message per Trainer call (and runs in every test)."""
        ready = torch.zeros(1, dtype=torch.int64, device=self.device)
        if self.sender:
            works = [dist.isend(ready, self._global[p], group=self.group, tag=_TAG_CONNECT) for p in self.peers]
            for work in works:
                if work is not None:  # None: this rank is outside the group (never here)
                    work.wait()
        else:
            dist.recv(ready, self._global[self.src], group=self.group, tag=_TAG_CONNECT)

    @property
    def sender(self) -> bool:
        return self.pp_rank == self.src

    def flush(self) -> None:
        """Wait until the last message has been taken (before this rank leaves: its process ending
        with a send in flight would cut the connection under a receiver)."""
        for work in self._in_flight[0::2]:
            work.wait()
        self._in_flight = []

    def send(self, loss: torch.Tensor, means: Logs, states: States | None = None, stop: bool = False) -> None:
        """On the last stage's rank, right after its last forward: send without waiting (``stop``: the
        step's code asked the Trainer to stop)."""
        self.flush()  # the previous step's message has long been taken
        states = states or {}
        spec = (_spec_of(means), _states_spec(states))
        blob = pickle.dumps(spec)
        signature = _signature(blob)
        names = blob if signature != self._sent_spec else b""
        self._sent_spec = signature
        values = torch.cat(
            [loss.detach().to(self.device, torch.float64).reshape(1)]
            + [
                (
                    v.detach().to(self.device, torch.float64)
                    if isinstance(v, torch.Tensor)
                    else torch.tensor(
                        0.0 if isinstance(v, MetricRef) else float(v), dtype=torch.float64, device=self.device
                    )
                ).reshape(1)
                for v, _ in means.values()
            ]
            + [v.detach().to(self.device, torch.float64).reshape(-1) for st in states.values() for v in st.values()]
        )
        header = torch.tensor([values.numel(), signature, len(names), int(stop)], dtype=torch.int64, device=self.device)
        tensors = [(header, _TAG_HEADER), (values, _TAG_VALUES)]
        if names:
            tensors.append((torch.frombuffer(bytearray(names), dtype=torch.uint8).to(self.device), _TAG_NAMES))
        for peer in self.peers:
            for t, tag in tensors:
                self._in_flight += [dist.isend(t, self._global[peer], group=self.group, tag=tag), t]

    def receive(self) -> tuple[torch.Tensor, Logs, States, bool]:
        """On the other ranks, at the end of their step: the loss, the logged means, the Metrics' step
        states and whether the step's code on the last stage asked the Trainer to stop."""
        src = self._global[self.src]
        header = torch.empty(4, dtype=torch.int64, device=self.device)
        dist.recv(header, src, group=self.group, tag=_TAG_HEADER)
        count, signature, nbytes, stop = header.tolist()  # on a GPU: the step's host read
        values = torch.empty(count, dtype=torch.float64, device=self.device)
        dist.recv(values, src, group=self.group, tag=_TAG_VALUES)
        if nbytes:
            blob = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            dist.recv(blob, src, group=self.group, tag=_TAG_NAMES)
            self._spec = (signature, pickle.loads(blob.cpu().numpy().tobytes()))
        if self._spec is None or self._spec[0] != signature:
            raise RuntimeError("the logged names were never received: the log channel lost a message")
        spec, state_spec = self._spec[1]
        means: Logs = {name: (_restore(values[i + 1], kind), kw) for i, (name, kw, kind) in enumerate(spec)}
        return values[0].float(), means, _unflatten(state_spec, values[1 + len(spec) :]), bool(stop)
