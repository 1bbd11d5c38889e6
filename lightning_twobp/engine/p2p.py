"""One rank's point-to-point traffic in its pipeline: tags, posting, receive buffers, shape agreement.

The executor says *what* to send and receive (the lowered schedule's :class:`Comm` ops); this module
does it with ``torch.distributed``:

* a run of consecutive comm ops is posted as one ``batch_isend_irecv`` (on NCCL a group, so a rank's
  activation send and its gradient receive progress together and cannot deadlock; the schedules pass
  ``check_comm_deadlock`` under that strict model);
* each message has its own tag: between two ranks several streams can interleave (the V and the loop
  maps send activations and gradients each way), and gloo matches by (peer, tag), so a message never
  lands in another's buffer. NCCL ignores tags and matches in posting order, which the communication
  pass keeps consistent per pair of ranks;
* a receive buffer exists only while its message is in use: it is allocated when the receive is posted
  (the lowering posts a receive right before the action that reads it, earlier only where the
  rendezvous or NCCL's posting order needs it: ``schedules.lower``) and :meth:`P2P.wait` hands it to
  its reader and lets go. An activation lives on as the stage's input (autograd may save it, and the
  stage keeps its inputs until the micro-batch's last backward action), a gradient until B, or until
  W where W reads it (a last Linear's weight gradient): one storage each, never a copy. Buffers kept
  per micro-batch for the whole run (as before) held m messages per direction and remote neighbour
  at all times. Their memory is reused by the allocator, not here: on a GPU its cache, on CPU glibc
  once :func:`lightning_twobp.engine.memory.keep_freed_memory` keeps freed blocks in the process (the
  strategy applies it), so a message's allocation costs no fresh page faults. Nothing is written into
  a buffer that anyone still reads, and a receive left posted by a failed step writes into a buffer
  no later step uses;
* the shapes between stages: the rank holding stage 0 sends a tiny signature of its micro-batches'
  shapes and dtypes to every other rank at the start of each step. Every rank's first action waits on
  stage 0's first forward anyway, so this costs a small message and no waiting, where an object
  collective would stop every rank until the slowest finished its previous step (no overlap of
  iterations). When the signature changes, all ranks exchange their metadata again (see
  :meth:`PipelineExecutor._exchange_meta`). What a rank changes on its own (autocast, ``requires_grad``)
  is caught when it sends: a tensor whose metadata differs from what the receiver expects raises,
  naming the stage and both metadata, instead of landing in a buffer of another shape;
* what a rank sends lives until it waits on the send: a gloo send completes only once the receiver
  has posted the matching receive (rendezvous, even for a few bytes), ``is_completed()`` stays False
  until ``wait()`` is called, and the work holds the tensor until it is dropped (probed on torch 2.13,
  CPU). Waiting on a send before its receive is posted can deadlock (two neighbours sending to each
  other), so the executor lets a send go (:meth:`P2P.release`) only where the schedule proves that
  receive posted (:func:`lightning_twobp.schedules.memory.send_releases`): the rest wait at the step's
  end (:meth:`P2P.finish_sends`).
"""

from __future__ import annotations

import datetime
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_twobp.private import pytree
from lightning_twobp.schedules import Comm, Schedule
from lightning_twobp.schedules.lower import message
from lightning_twobp.schedules.memory import Message

__all__ = ["MAX_TENSORS", "P2P", "PeerLost", "TensorMeta"]


MAX_TENSORS = 64  # tensors one stage may pass to the next (part of the message tag)
_SIGNATURE_TAG = 2**31 - 2  # above every message tag: ((mb * S + edge) * 2 + dir) * 64 + index
_EVAL_TAG = 2**31 - 3  # evaluation's activations (forward-only passes), a stream of their own
# Evaluation's header: the count of tensors, then per tensor its dtype's index here, its ndim and shape;
# -1 first: an object follows instead (a value the header cannot say)
_HEADER = 128
_WIRE_DTYPES = (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128,
)  # fmt: skip


_NOT_ON_NCCL = (torch.int16, torch.complex64, torch.complex128)  # torch's NCCL type map has none of these


# Why a peer's wait failed on a closed connection, where nothing else is known. A peer that told its own
# failure first (engine/failure.py) is said to have closed it after that failure instead.
CLOSED = "its connection closed: the process died or was killed"


class PeerLost(RuntimeError):
    """Another rank of the pipeline stopped answering: its process died, or nothing came within the
    timeout (hung, stopped, or far slower). The message names it by pipeline rank, stage and host."""


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    # The order of the dims from the outermost in memory (a dense tensor with permuted strides: an LSTM's
    # batch-first output is (T, B, C) in memory), () when contiguous or not dense. An activation travels in
    # that order and is received with the sender's strides: a layer's kernel may round differently on another
    # layout (bf16 matmuls on CPU do), which made the next stage differ from one process. Not compared: a
    # layout is not a shape.
    perm: tuple[int, ...] = field(default=(), compare=False)

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMeta:
        return cls(tuple(t.shape), t.dtype, t.requires_grad, _layout(t))

    def empty(self, device: torch.device) -> torch.Tensor:
        """A contiguous receive buffer, in this layout's order (:meth:`unwire` gives the tensor)."""
        return torch.empty(
            [self.shape[d] for d in self.perm] if self.perm else self.shape, dtype=self.dtype, device=device
        )

    def unwire(self, buf: torch.Tensor) -> torch.Tensor:
        """The received tensor over ``buf``, with its sender's strides."""
        return buf.permute([self.perm.index(d) for d in range(len(self.perm))]) if self.perm else buf

    def wire(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as it travels: contiguous in this layout's order (no copy where it is laid out so)."""
        if not self.perm or tuple(t.shape) != self.shape:
            return t.contiguous()
        return t.permute(self.perm).contiguous()


def _layout(t: torch.Tensor) -> tuple[int, ...]:
    """The dims of ``t`` from the outermost in memory, where ``t`` is dense with permuted strides; else ()."""
    if t.is_contiguous() or t.dim() < 2:
        return ()
    strides = t.stride()
    perm = tuple(sorted(range(t.dim()), key=lambda d: (-strides[d], d)))
    return perm if t.permute(perm).is_contiguous() else ()

    def __str__(self) -> str:
        grad = ", requires grad" if self.requires_grad else ""
        return f"{tuple(self.shape)} {str(self.dtype).removeprefix('torch.')}{grad}"


class P2P:
    """Sends and receives of one pipeline rank. ``rank`` is the rank in ``group`` (the pipeline).

    ``timeout`` (seconds, ``None`` for the process group's own) bounds every wait on a peer: a peer
    that sends nothing for that long is reported as lost (:class:`PeerLost`), by pipeline rank, stage
    and host, instead of the process group's default of 30 minutes.
    """

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
        timeout: float | None = None,
        shape_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.schedule = schedule
        self.rank = rank
        self.group = group
        # stage 0's input signature travels here: the same ranks in the same order as ``group``, or ``group``
        # itself (on NCCL a group's operations run in order, so on ``group`` the signature's send holds the
        # step's first activations back until every peer has posted its receive)
        self.shape_group = group if shape_group is None else shape_group
        self.device = device
        self.timeout = None if timeout is None else datetime.timedelta(seconds=timeout)
        world = schedule.num_ranks
        if group is None or group is dist.GroupMember.WORLD:
            self.global_ranks = list(range(world))
        else:
            self.global_ranks = [dist.get_global_rank(group, r) for r in range(world)]
        # Host names, once, so that a lost peer can be named where it ran.
        self.hosts = [socket.gethostname()] * world
        if world > 1:
            dist.all_gather_object(self.hosts, socket.gethostname(), group=group)
        self.meta_in: dict[int, list[TensorMeta]] = {}  # stage -> metadata of its inputs
        self.meta_out: dict[int, list[TensorMeta]] = {}  # stage -> metadata of its outputs (non-last)
        self._signature: int | None = None
        self.start_step()

    # ------------------------------------------------------------------ per step
    def start_step(self) -> None:
        self._recvs: dict[tuple[str, int, int], tuple[list, list[torch.Tensor], int]] = {}
        # per message sent and not yet waited on: (works, the pipeline ranks they go to, its tensors)
        self._sends: dict[Message | int, tuple[list, list[int], list[torch.Tensor]]] = {}
        self._arrived: set[Message] = set()  # messages received this step that carried tensors
        self.wait_time = 0.0  # seconds blocked on receives since the last reset (for records)
        # recording on a GPU: CUDA (before, after) events around each receive's wait since the last reset, so
        # that the stall is read on the device's clock, as the ops' times are (the host's wait also covers
        # the work the device still had queued)
        self.wait_events: list[tuple[Any, Any]] | None = None

    def finish_sends(self) -> None:
        """Wait for every send of the step not let go already (their tensors must live until then)."""
        for works, peers, _ in self._sends.values():
            for w in works:
                self._wait(w, peers, "the receipt of what this rank sent")
        self._sends = {}

    def release(self, pairs: Sequence[tuple[Message, Message]]) -> None:
        """Wait on each sent message ``x`` of ``pairs`` and drop it, if its proof ``y`` (a message from the
        same peer, posted no earlier than ``x``'s receive: ``schedules.memory.send_releases``) has
        arrived carrying tensors. The receive is then posted, so the wait ends as soon as the transfer
        does and cannot deadlock; a message without its proof waits for :meth:`finish_sends`."""
        for x, y in pairs:
            if y in self._arrived and x in self._sends:
                works, peers, _ = self._sends.pop(x)
                for w in works:
                    self._wait(w, peers, "the receipt of what this rank sent")

    def sending(self) -> list[torch.Tensor]:
        """The tensors this rank has sent this step and not let go of yet (their sends hold them)."""
        return [t for _, _, tensors in self._sends.values() for t in tensors]

    def receive_buffers(self) -> list[torch.Tensor]:
        """The buffers of the receives posted and not yet waited for (the module docstring): once
        waited, a message is its reader's (a stage's input, the gradient its B reads)."""
        return [b for _, bufs, _ in self._recvs.values() for b in bufs]

    def _wait(self, work: Any, peers: Sequence[int], what: str) -> None:
        """``work.wait()``, bounded by the timeout; a lost peer raises :class:`PeerLost` naming it.

        On a GPU the wait is the stream's, unbounded here: NCCL's ``wait(timeout)`` blocks the host, polling the
        transfer every 1-10 ms (torch's ``kSynchronizeBusyWaitMillis``), so every receive would cost a host
        synchronisation and up to a poll interval, and the host could no longer queue the next kernels behind
        it. ``wait()`` makes the current stream wait for the transfer instead, as torch.distributed.pipelining
        waits. A peer that never sends is then bounded by the process group's own timeout (``pipeline_timeout``,
        at least 60 s: :class:`~lightning_twobp.lightning.strategy.TwoBPStrategy`), after which NCCL's watchdog
        ends the process, naming the operation rather than the peer."""
        try:
            if self.timeout is None or self.device.type == "cuda":
                work.wait()
            else:
                work.wait(self.timeout)
        except RuntimeError as e:
            raise PeerLost(self.describe_loss(peers, what, e)) from e

    def describe_loss(self, peers: Sequence[int], what: str, error: BaseException) -> str:
        text = str(error)
        names = " or ".join(self.describe_rank(r) for r in sorted(set(peers)))
        if "Timed out" in text or "timed out" in text:
            secs = self.timeout.total_seconds() if self.timeout is not None else None
            why = (
                f"nothing came for {secs:g} s: it is hung, stopped or far slower than this rank (raise the "
                f"timeout if a step can take that long)"
                if secs is not None
                else "the wait timed out"
            )
        elif any(k in text for k in ("Connection closed", "Connection reset", "closed by peer", "Broken pipe")):
            why = CLOSED
        else:
            why = f"{type(error).__name__}: {text}"
        return f"{names} stopped answering while pipeline rank {self.rank} waited for {what}: {why}"

    def describe_rank(self, pp_rank: int) -> str:
        held = self.schedule.stages_of(pp_rank)
        stages = ("stage " if len(held) == 1 else "stages ") + ", ".join(map(str, held))
        return (
            f"pipeline rank {pp_rank} ({stages}, global rank {self.global_ranks[pp_rank]}, host {self.hosts[pp_rank]})"
        )

    def new_shapes(self) -> None:
        """The shapes between stages changed: forget their metadata (receive buffers follow it)."""
        self.meta_in.clear()
        self.meta_out.clear()

    def forget_shapes(self) -> None:
        """Forget everything learned about shapes, so that the next step agrees on them again: after a
        failed step or on request."""
        self.new_shapes()
        self._signature = None

    # ------------------------------------------------------------------ shapes
    def signature_changed(self, local: int | None) -> bool:
        """Whether stage 0's input signature differs from the last step's, on every rank alike.

        ``local`` is this rank's signature when it holds stage 0 (else ``None``); that rank sends it to
        the others, who receive it before anything else of the step."""
        if self.schedule.num_ranks == 1:
            value = local
        elif local is not None:
            # held in its send until finish_sends, the step's end: schedules.memory.SIGNATURE_BYTES counts it
            sig = torch.tensor([local], dtype=torch.int64, device=self.device)
            others = [r for r in range(self.schedule.num_ranks) if r != self.rank]
            try:
                works = [
                    dist.isend(sig, self.global_ranks[r], group=self.shape_group, tag=_SIGNATURE_TAG) for r in others
                ]
            except RuntimeError as e:  # gloo posts a send to a dead rank's closed connection at once
                raise PeerLost(
                    self.describe_loss(others, "the start of the step (sending stage 0's input shapes)", e)
                ) from e
            self._sends[_SIGNATURE_TAG] = ([w for w in works if w is not None], others, [sig])
            value = local
        else:
            sig = torch.empty(1, dtype=torch.int64, device=self.device)
            src = self.schedule.stage_to_rank[0]
            work = dist.irecv(sig, self.global_ranks[src], group=self.shape_group, tag=_SIGNATURE_TAG)
            self._wait(work, [src], "the start of the step (stage 0's input shapes)")
            value = int(sig.item())  # on a GPU, the step's one host sync
        changed = value != self._signature
        self._signature = value
        return changed

    # ------------------------------------------------------------------ messages
    def tag(self, direction: str, edge: int, mb: int, index: int) -> int:
        """A tag per message (see the module docstring)."""
        if index >= MAX_TENSORS:
            raise ValueError(f"at most {MAX_TENSORS} tensors may pass between two stages, got {index + 1}")
        return ((mb * self.schedule.num_stages + edge) * 2 + (direction == "B")) * MAX_TENSORS + index

    def _recv_metas(self, direction: str, stage: int) -> list[TensorMeta]:
        if direction == "F":
            return self.meta_in[stage]
        return [mt for mt in self.meta_out[stage] if mt.requires_grad]

    def _new_buffers(self, key: tuple[str, int, int]) -> list[torch.Tensor]:
        """Fresh buffers for one receive, made as it is posted (the module docstring)."""
        if key[0] == "F":  # an activation: received with its sender's layout
            return [mt.empty(self.device) for mt in self._recv_metas(key[0], key[1])]
        return [torch.empty(mt.shape, dtype=mt.dtype, device=self.device) for mt in self._recv_metas(key[0], key[1])]

    def post(self, comms: Sequence[Comm], outgoing: dict[tuple[str, int, int], list[torch.Tensor]]) -> None:
        """Post one batch: the sends take their tensors out of ``outgoing`` (keyed like the receives,
        ``(direction, stage, micro-batch)``); the receives are waited for by :meth:`wait`."""
        ops: list[dist.P2POp] = []
        owner: list[tuple[bool, tuple[str, int, int]]] = []  # per op: (is send, its receive key or message)
        recvs: dict[tuple[str, int, int], tuple[list[torch.Tensor], int]] = {}
        sends: dict[Message, tuple[list[torch.Tensor], int]] = {}
        for c in comms:
            peer = self.global_ranks[c.peer]
            key = (c.kind[-1], c.stage, c.microbatch)
            if c.is_send:
                edge = c.stage if key[0] == "F" else c.stage - 1
                if key[0] == "F":  # an activation: in the layout the receiver's buffer has
                    tensors = [mt.wire(t) for t, mt in zip(outgoing.pop(key), self.meta_out[c.stage], strict=True)]
                else:
                    tensors = [t.contiguous() for t in outgoing.pop(key)]
                for i, t in enumerate(tensors):
                    ops.append(dist.P2POp(dist.isend, t, peer, self.group, self.tag(key[0], edge, c.microbatch, i)))
                    owner.append((True, message(c)))
                sends[message(c)] = (tensors, c.peer)
            else:
                edge = c.stage - 1 if key[0] == "F" else c.stage
                bufs = self._new_buffers(key)
                ops.extend(
                    dist.P2POp(dist.irecv, b, peer, self.group, self.tag(key[0], edge, c.microbatch, i))
                    for i, b in enumerate(bufs)
                )
                owner.extend([(False, key)] * len(bufs))
                recvs[key] = (bufs, c.peer)
        if not ops:  # only messages without tensors (an edge no gradient crosses): nothing to post
            for key, (bufs, peer) in recvs.items():
                self._recvs[key] = ([], bufs, peer)
            return
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            peers = [p for _, p in sends.values()] + [p for _, p in recvs.values()]
            raise PeerLost(self.describe_loss(peers, "a send or receive to be posted", e)) from e
        # One work per op (gloo): each must be waited exactly once, since a gloo work's wait blocks
        # for a further completion when called again. Else one work for the whole group (NCCL
        # coalescing): waiting on it again is a no-op.
        per_op = len(works) == len(ops)

        def mine(op: tuple[bool, tuple[str, int, int]]) -> list:
            return [w for w, o in zip(works, owner, strict=True) if o == op] if per_op else works

        for key, (bufs, peer) in recvs.items():
            self._recvs[key] = (mine((False, key)), bufs, peer)
        for msg, (tensors, peer) in sends.items():
            self._sends[msg] = (mine((True, msg)), [peer], tensors)

    def wait(self, key: tuple[str, int, int]) -> tuple[torch.Tensor, ...]:
        """The tensors of a posted receive, once they have arrived; this object lets go of them (and of
        the receive's works, which hold them too). Activations that require grad come back as fresh
        leaves (``detach().requires_grad_()``) over the buffer."""
        works, bufs, peer = self._recvs.pop(key)
        t = time.perf_counter()
        timed = self.wait_events is not None and self.device.type == "cuda"
        if timed:
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record()
        direction, stage, mb = key
        what = f"the input of {stage}F{mb}" if direction == "F" else f"the output gradient of {stage}B{mb}"
        for w in works:
            self._wait(w, [peer], what)
        self.wait_time += time.perf_counter() - t
        if timed:
            after.record()
            self.wait_events.append((before, after))  # type: ignore[union-attr]  # timed: not None
        if bufs:  # a message that carried tensors: proof that its sender posted what came before it
            self._arrived.add(("F", stage - 1, mb) if direction == "F" else ("B", stage, mb))
        if key[0] == "F":
            metas = self.meta_in[key[1]]
            received = [mt.unwire(b) for b, mt in zip(bufs, metas, strict=False)]
            return tuple(
                b.detach().requires_grad_() if mt.requires_grad else b for b, mt in zip(received, metas, strict=False)
            )
        return tuple(bufs)

    # ------------------------------------------------------------------ evaluation's activations
    def send_tensors(self, values: tuple, to_stage: int) -> None:
        """A forward-only pass's output to the next stage: a fixed-size header of shapes and dtypes, then
        each tensor as it is (no pickling, no copy through the host on a GPU; the shapes may change between
        micro-batches, a last smaller batch). A value the header cannot say goes as an object."""
        peer = self.schedule.stage_to_rank[to_stage]
        header = _header(values, "nccl" if self.device.type == "cuda" else "gloo")  # NCCL carries GPU tensors
        marker = header if header is not None else torch.full((_HEADER,), -1)
        try:
            dist.send(marker.to(self.device), self.global_ranks[peer], group=self.group, tag=_EVAL_TAG)
            for t in values if header is not None else ():
                perm = _layout(t)  # as the header says: with its layout, which the receiver puts back
                dist.send(
                    (t.permute(perm) if perm else t).contiguous(),
                    self.global_ranks[peer],
                    group=self.group,
                    tag=_EVAL_TAG,
                )
        except RuntimeError as e:
            raise PeerLost(self.describe_loss([peer], f"stage {to_stage} to take its input", e)) from e
        if header is None:  # through the host: a GPU tensor pickled as it is would land on this rank's GPU index
            self.send_object(pytree.tree_map_only(torch.Tensor, torch.Tensor.cpu, values), to_stage)

    def recv_tensors(self, from_stage: int) -> tuple:
        """What :meth:`send_tensors` sent, on this rank's device."""
        peer = self.schedule.stage_to_rank[from_stage]
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        try:
            dist.recv(header, self.global_ranks[peer], group=self.group, tag=_EVAL_TAG)
            metas = _read_header(header.cpu())
            if metas is None:
                values = self.recv_object(from_stage)
                return tuple(pytree.tree_map_only(torch.Tensor, lambda t: t.to(self.device), values))
            bufs = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape, _ in metas]
            for t in bufs:
                dist.recv(t, self.global_ranks[peer], group=self.group, tag=_EVAL_TAG)
            out = tuple(
                b.permute([perm.index(d) for d in range(len(perm))])
                for b, (_, _, perm) in zip(bufs, metas, strict=True)
            )
        except RuntimeError as e:
            raise PeerLost(self.describe_loss([peer], f"the output of stage {from_stage}", e)) from e
        return out

    # ------------------------------------------------------------------ objects (shape exchange)
    def send_object(self, obj: Any, to_stage: int) -> None:
        peer = self.schedule.stage_to_rank[to_stage]
        try:
            dist.send_object_list([obj], dst=self.global_ranks[peer], group=self.group, device=self._object_device())
        except RuntimeError as e:
            raise PeerLost(self.describe_loss([peer], f"stage {to_stage} to take its input", e)) from e

    def recv_object(self, from_stage: int) -> Any:
        box = [None]
        peer = self.schedule.stage_to_rank[from_stage]
        try:
            dist.recv_object_list(box, src=self.global_ranks[peer], group=self.group, device=self._object_device())
        except RuntimeError as e:
            raise PeerLost(self.describe_loss([peer], f"the output of stage {from_stage}", e)) from e
        return box[0]

    def _object_device(self) -> torch.device | None:
        # Object collectives on NCCL need the current CUDA device; on gloo the CPU.
        return self.device if self.device.type == "cuda" else None


def check_outgoing(actual: Sequence[TensorMeta], expected: Sequence[TensorMeta], what: str) -> None:
    """Raise if what a stage is about to send differs from what its peer will receive into (shape,
    dtype, and for activations whether they require grad)."""
    if list(actual) != list(expected):
        raise RuntimeError(
            f"{what} changed since the shapes between stages were agreed: now "
            f"[{', '.join(map(str, actual))}], the receiving rank expects [{', '.join(map(str, expected))}]. "
            f"Shapes may change with the first stage's input (every rank then agrees on them again); a change "
            f"made on one rank alone (autocast, requires_grad, a layer's output) needs executor.reset_shapes() "
            f"on every rank before the next step (trainer.strategy.reset_shapes() under Lightning, e.g. in the "
            f"callback that freezes or unfreezes layers)"
        )


def _header(values: tuple, backend: str) -> torch.Tensor | None:
    """``values``' count, dtypes and shapes as :data:`_HEADER` int64s; None where they do not fit one, or
    where ``backend`` cannot send one of them (NCCL has no int16 or complex type)."""
    words = [len(values)]
    for t in values:
        if not isinstance(t, torch.Tensor) or t.dtype not in _WIRE_DTYPES:
            return None
        if backend == "nccl" and t.dtype in _NOT_ON_NCCL:
            return None
        perm = _layout(t) or tuple(range(t.dim()))  # the layout it travels in (TensorMeta.perm)
        words += [_WIRE_DTYPES.index(t.dtype), t.dim(), *(t.shape[d] for d in perm), *perm]
    if len(words) > _HEADER:
        return None
    return torch.tensor(words + [0] * (_HEADER - len(words)), dtype=torch.int64)


def _read_header(header: torch.Tensor) -> list[tuple[torch.dtype, tuple[int, ...], tuple[int, ...]]] | None:
    """Each tensor's dtype, shape as it travels, and the order of its dims in that layout."""
    words = header.tolist()
    if words[0] < 0:
        return None
    metas, i = [], 1
    for _ in range(words[0]):
        dtype, ndim = _WIRE_DTYPES[words[i]], words[i + 1]
        metas.append((dtype, tuple(words[i + 2 : i + 2 + ndim]), tuple(words[i + 2 + ndim : i + 2 + 2 * ndim])))
        i += 2 + 2 * ndim
    return metas
