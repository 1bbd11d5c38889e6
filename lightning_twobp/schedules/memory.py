"""What a schedule holds: one replay of each rank's action order, in micro-batch counts or in bytes.

A (stage, micro-batch) pair is allocated by its F and freed by its backward, in two steps when the
backward is split (the Zero Bubble paper's accounting, Qi et al. ICLR 2024 §3.1; the 2BP paper's
"intermediate derivatives", Rae et al. 2024 §5):

* ``F``  adds ``activation(s, m)``: what the forward saves for the backward (the paper's M_B);
* ``B``  trades it for ``held(s, m)``: what W still needs (the weight GEMMs' inputs and output
  gradients, the paper's M_W), or the whole graph where a layer has no direct weight formula;
* ``W``  frees ``held(s, m)`` (a batched W, for each of its micro-batches);
* ``BW`` frees ``activation(s, m)`` at once.

A rank runs its actions one at a time, so walking its list in order visits every allocation and
release in time order: the peak over the walk is the rank's peak, whatever the costs. With
``activation = held = 1`` the replay counts the pairs held from F to their last B/W/BW
(``SimResult.peak_inflight``); with ``held = 0``, from F to B (:func:`peak_activations`, the count the
paper states its budgets in). :class:`MemoryCosts` gives the bytes per stage; ``simulate`` adds each
rank's fixed bytes (weights, gradients, optimizer state) to report its peak bytes:

    peak_bytes[r] = sum_{s on r} fixed[s] + max_t (sum_{s on r} (a_s(t) activation[s] + w_s(t) held[s]) + msg_r(t))

where ``a_s(t)`` counts stage s's micro-batches past F and not yet past B at list position t, and
``w_s(t)`` those past B and not yet past W; with messages between ranks, ``msg_r(t)`` adds what a rank
has sent and not yet let go of (:func:`send_releases`) and what it has received into a buffer and
still holds (below).

**Received messages.** The executor makes a receive buffer as it posts the receive (the lowering
posts it in the batch before the action that reads it, earlier only where the rendezvous or NCCL's
posting order needs it) and hands it to its reader: an activation becomes the stage's input, which
the stage keeps, and autograd may save, until the micro-batch's last backward action (W, or BW); a
gradient is read by B (or BW), and the part W reads (``grad_held``) lives until W. One storage each,
counted once: those parts leave ``activation`` and ``held`` (:meth:`MemoryCosts.placed`).

**Sent messages.** A gloo send completes only once the receiver has posted the matching receive, and
its work keeps the tensor until it is waited. Waiting on it too early can deadlock (both neighbours
sending to each other), so a rank waits on a send only once it has *proof* that the receive is
posted: it has received a message that the receiver posted in the same batch as that receive or
later. :func:`send_releases` finds, per rank, the first compute action at whose end that holds. In
1F1B's steady state, the activation a rank sends with F k+1 goes at B k (whose gradient the next rank
sent after it posted the receive of k+1); without such a message it waits until the step's end.
The step's signature (stage 0's input shapes, one int64 sent to every other rank at the step's start)
is held that way for the whole step: :class:`~.auto.Profile` adds its ``SIGNATURE_BYTES`` to stage 0's
fixed bytes.

**The data-parallel reduce.** With replicas (``data_parallel="replicate"``) a stage's gradients go into
one flat buffer per dtype at the stage's last W (or BW), the reduce's operand, which lives until the
step's end (:class:`~lightning_twobp.lightning.grads.ReplicaReduce`): ``reduced`` bytes per stage, added
to every list position from that action on (with two stages a rank, the first to finish holds its
buffer under the other's remaining work).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .ir import Action, Schedule
from .lower import Comm, Op, lower_communication, message
from .per_stage import PerStage, check_stage_count, stage_value, store_per_stage

__all__ = [
    "SIGNATURE_BYTES",
    "MemoryCosts",
    "MemoryPeaks",
    "memory_levels",
    "peak_bytes",
    "peak_activations",
    "peak_inflight",
    "reduce_levels",
    "replay_memory",
    "row_peak",
    "send_releases",
]

# The step's signature: one int64 that the rank holding stage 0 sends every other rank at the step's start
# (engine.p2p.P2P.signature_changed) and holds in its send until the step's end. Profile.costs counts it.
SIGNATURE_BYTES = 8
_FIELDS = (
    "activation",
    "held",
    "fixed",
    "message",
    "input_saved",
    "grad_held",
    "input_held",
    "output_kept",
    "reduced",
)
Message = tuple[str, int, int]  # (direction F/B, edge stage, micro-batch): :func:`.lower.message`
# Bytes of one (stage, micro-batch): a number for all, one per stage, or one per (stage, micro-batch).
PerPair = PerStage | Mapping[tuple[int, int], float] | Callable[[int, int], float]


@dataclass(frozen=True)
class MemoryCosts:
    """Per stage: bytes one micro-batch holds from F to B (``activation``), from B to W (``held``),
    and the stage's ``fixed`` bytes; each a number or one number per stage.

    Five optional figures place the messages between stages (what depends on which rank holds the
    neighbouring stage, so :func:`peak_bytes` applies them once the schedule is known): ``message``,
    the bytes of one micro-batch's output of the stage (its gradient has the same size);
    ``input_saved``, the part of ``activation`` that is the stage's input (its first layer saves it);
    ``grad_held`` and ``input_held``, the parts of ``held`` that are the gradient of the stage's output
    as it arrived and the stage's input (W reads them: a last and a first Linear). Where the neighbour
    is on another rank those parts are the receive buffer the message arrived in, held from the
    receive's post to the micro-batch's last use (the module docstring), so they are counted there.
    Where the previous stage is on the same rank, the input is that stage's output, which it holds
    until its own B, after this stage's B: ``input_saved`` is counted there. ``output_kept``, the part
    of ``activation`` that is the stage's output kept only as the root of its graph (0 when its last
    layer saves it anyway): where the next stage is remote the executor lets the stage drop it once it
    is sent, so it is held as a sent message instead (:func:`send_releases`); an input gradient sent
    back is held the same way, ``message`` of the previous stage. ``reduced``: the data-parallel reduce's
    buffer, from the stage's last W (or BW) to the step's end (the module docstring).

    The unit defaults (1, 1, 0; no messages) make peak bytes the count of (stage, micro-batch) pairs
    held from F to their last backward action, so callers that pass no memory costs see ``peak_inflight``.
    """

    activation: PerStage = 1
    held: PerStage = 1
    fixed: PerStage = 0
    message: PerStage = 0
    input_saved: PerStage = 0
    grad_held: PerStage = 0
    input_held: PerStage = 0
    output_kept: PerStage = 0
    reduced: PerStage = 0

    def __post_init__(self) -> None:
        store_per_stage(self, "MemoryCosts", _FIELDS)

    def check(self, num_stages: int) -> None:
        """Raise ValueError when a per-stage sequence does not have one value per stage."""
        check_stage_count(self, "MemoryCosts", _FIELDS, num_stages)

    def of(self, name: str, stage: int) -> float:
        """``activation``, ``held``, ``fixed``, ... bytes of ``stage``."""
        return stage_value(getattr(self, name), stage)

    def fixed_of(self, schedule: Schedule) -> tuple[float, ...]:
        """Each rank's fixed bytes: the sum over the stages it holds (receive buffers are not fixed: they
        live per message, :func:`peak_bytes`)."""
        return tuple(sum(self.of("fixed", s) for s in schedule.stages_of(r)) for r in range(schedule.num_ranks))

    def placed(self, schedule: Schedule) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per stage, ``activation`` and ``held`` less what is counted elsewhere on this layout: in a
        received message, (the input from F to B) as the previous stage's output, or (the output sent
        on) as a sent message (:func:`peak_bytes`)."""
        act, held = [], []
        for s in range(schedule.num_stages):
            remote_in, remote_out = _remote(schedule, s)
            act.append(
                self.of("activation", s)
                - (self.of("input_saved", s) if s > 0 else 0.0)
                - (self.of("output_kept", s) if remote_out else 0.0)
            )
            held.append(
                self.of("held", s)
                - (self.of("grad_held", s) if remote_out else 0.0)
                - (self.of("input_held", s) if remote_in else 0.0)
            )
        return tuple(act), tuple(held)


def _remote(schedule: Schedule, s: int) -> tuple[bool, bool]:
    """Whether stage ``s``'s previous and next stages are on another rank."""
    owner = schedule.stage_to_rank
    return (s > 0 and owner[s - 1] != owner[s], s < schedule.num_stages - 1 and owner[s + 1] != owner[s])


@dataclass(frozen=True)
class MemoryPeaks:
    """The most held at once, per rank and per stage (fixed bytes not included)."""

    per_rank: tuple[float, ...]
    per_stage: tuple[float, ...]


def _per_pair(value: PerPair) -> Callable[[int, int], float]:
    if callable(value):
        return value
    if isinstance(value, Mapping):
        return lambda s, m: value[(s, m)]
    if isinstance(value, (int, float)):
        return lambda s, m: value
    per_stage = tuple(value)
    return lambda s, m: per_stage[s]


def _change(kind: str, act: Callable[[int, int], float], keep: Callable[[int, int], float], s: int, mb: int) -> float:
    if kind == "F":
        return act(s, mb)
    if kind == "B":
        return keep(s, mb) - act(s, mb)
    return -keep(s, mb) if kind == "W" else -act(s, mb)


def memory_levels(schedule: Schedule, activation: PerPair = 1, held: PerPair = 1) -> tuple[tuple[float, ...], ...]:
    """Per rank, what it holds right after each action of its list (see the module docstring).

    ``activation`` and ``held`` are a number, one number per stage, a mapping ``(stage, mb) -> bytes``
    or a function of ``(stage, mb)``.
    """
    return tuple(tuple(sum(levels.values()) for levels in _walk(row, activation, held)) for row in schedule.actions)


def replay_memory(schedule: Schedule, activation: PerPair = 1, held: PerPair = 1) -> MemoryPeaks:
    """The peaks over :func:`memory_levels`: per rank, and per stage (on its rank)."""
    per_stage = [0] * schedule.num_stages
    per_rank = []
    for row in schedule.actions:
        peak = 0
        for levels in _walk(row, activation, held):
            for s, level in levels.items():
                per_stage[s] = max(per_stage[s], level)
            peak = max(peak, sum(levels.values()))
        per_rank.append(peak)
    return MemoryPeaks(per_rank=tuple(per_rank), per_stage=tuple(per_stage))


def row_peak(row: Sequence[Action], activation: PerPair = 1, held: PerPair = 1) -> float:
    """The most one rank's list ``row`` holds at once (what :func:`replay_memory` reports per rank)."""
    return max((sum(levels.values()) for levels in _walk(row, activation, held)), default=0)


def _walk(row: Sequence[Action], activation: PerPair, held: PerPair):
    """Each stage's level after each action of ``row`` (one dict, updated in place, yielded per action)."""
    act, keep = _per_pair(activation), _per_pair(held)
    now: dict[int, float] = {}
    for action in row:
        s = action.stage
        for mb in action.microbatches:
            now[s] = now.get(s, 0) + _change(action.kind, act, keep, s, mb)
        yield now


def peak_bytes(schedule: Schedule, memory: MemoryCosts) -> tuple[float, ...]:
    """Per rank: its fixed bytes plus the most its micro-batches and its messages hold at once (the
    module's formula), the messages placed (:meth:`MemoryCosts.placed`, :func:`send_releases`)."""
    act, keep = memory.placed(schedule)
    messages = _message_levels(schedule, memory)
    peaks = []
    reduced = lambda s: memory.of("reduced", s)  # noqa: E731
    for r, row in enumerate(schedule.actions):
        levels = (sum(now.values()) for now in _walk(row, act, keep))
        extras = (m + d for m, d in zip(messages[r], reduce_levels(row, reduced), strict=True))
        peaks.append(max((level + extra for level, extra in zip(levels, extras, strict=True)), default=0.0))
    return tuple(fixed + h for fixed, h in zip(memory.fixed_of(schedule), peaks, strict=False))


def reduce_levels(row: Sequence[Action], reduced: Callable[[int], float]) -> list[float]:
    """The bytes of data-parallel reduce buffers ``row``'s rank holds at the end of each of its actions: each
    stage's ``reduced(stage)`` from its last W or BW on (where the lowering puts its reduce: ``add_grad_reduce``)."""
    last = {a.stage: i for i, a in enumerate(row) if a.kind in ("W", "BW")}
    starts = sorted((i, reduced(s)) for s, i in last.items())
    out, held, k = [], 0.0, 0
    for i in range(len(row)):
        while k < len(starts) and starts[k][0] == i:
            held += starts[k][1]
            k += 1
        out.append(held)
    return out


def _message_levels(schedule: Schedule, memory: MemoryCosts) -> list[list[float]]:
    """Per rank, the bytes of messages it holds at the end of each action of its row: each held over
    the positions ``start <= t < end`` of one :func:`_message_spans` span."""
    if not any(memory.of(name, s) for name in ("message", "output_kept") for s in range(schedule.num_stages)):
        return [[0.0] * len(row) for row in schedule.actions]  # nothing crosses ranks: skip the lowering
    lowered = lower_communication(schedule)
    out = []
    for r, (ops, releases) in enumerate(zip(lowered, send_releases(lowered), strict=True)):
        change = [0.0] * (len(schedule.actions[r]) + 1)  # per position: what starts or ends there
        for size, start, end in _message_spans(ops, releases, memory, len(schedule.actions[r])):
            change[start] += size
            change[end] -= size
        out.append(list(itertools.accumulate(change[:-1])))
    return out


def _message_spans(
    ops: Sequence[object], releases: Mapping[int, tuple[tuple[Message, Message], ...]], memory: MemoryCosts, n: int
) -> list[tuple[float, int, int]]:
    """One rank's messages as (bytes, first position held, first position no longer held), ``n`` the
    step's end. Sent: from the action that made it (in the executor's outbox, then in its send) to the
    end of its release action (:func:`send_releases`), or to the step's end. Received: from the first
    action after its post to its reader's last use (the module docstring)."""
    position = _positions(ops)
    done = {
        (a.kind, a.stage, mb): position[i] for i, a in enumerate(ops) if isinstance(a, Action) for mb in a.microbatches
    }
    gone = {x: position[j] for j, pairs in releases.items() for x, _ in pairs}
    spans: list[tuple[float, int, int]] = []
    for i, op in enumerate(ops):
        if not isinstance(op, Comm):
            continue
        s, mb = op.stage, op.microbatch
        backward = done[("B", s, mb)] if ("B", s, mb) in done else done[("BW", s, mb)]  # every mb has one
        last = done.get(("W", s, mb), backward)  # the stage lets go of the micro-batch here
        if op.kind == "SEND_F":
            spans.append((memory.of("output_kept", s), done[("F", s, mb)], gone.get(message(op), n)))
        elif op.kind == "SEND_B":
            spans.append((memory.of("message", s - 1), backward, gone.get(message(op), n)))
        elif op.kind == "RECV_F":  # the stage's input: its inputs are kept until the last backward action
            spans.append((memory.of("message", s - 1), position[i] + 1, last))
        else:  # RECV_B: read by B; what W reads of it until W
            grad = memory.of("grad_held", s)
            spans += [(memory.of("message", s) - grad, position[i] + 1, backward), (grad, position[i] + 1, last)]
    return spans


def _positions(ops: Sequence[object]) -> list[int]:
    """Per op of a lowered row, the index in the schedule's row of the last action at or before it."""
    out, k = [], -1
    for op in ops:
        k += isinstance(op, Action)
        out.append(k)
    return out


def send_releases(
    lowered: Sequence[Sequence[Op | object]],
) -> tuple[dict[int, tuple[tuple[Message, Message], ...]], ...]:
    """Per rank of a lowered schedule: op index ``j`` of a compute action -> the messages this rank
    sent that it may wait on and let go of at the end of that action, each with its proof, the
    message received from the same peer that shows the receive is posted (the module docstring).

    The proof for a message X sent to rank B is any message Y that B sends back, posted in the batch
    where B posts X's receive or later: once this rank holds Y, B has posted X's receive (inside one
    batch, every op is posted before the call returns, so even a Y posted before X's receive in that
    batch shows it will be, with nothing more from this rank). X is let go at the end of the first
    compute action at or after both its own post and the receipt of its earliest such Y; a message
    with no such Y is let go at the step's end. Ops that are neither :class:`Comm` nor
    :class:`Action` (a data-parallel reduce) are skipped. Only direct proofs count (none through a
    third rank): fewer releases, never a wrong one. Y must carry tensors to prove anything, which
    the executor checks when it lets go (an edge whose stages pass no gradients proves nothing).
    """
    posted, consumer = [], []
    for ops in lowered:
        batch: dict[tuple[bool, Message], tuple[int, int]] = {}  # (is send, message) -> (batch start, peer)
        start, at = -1, {}
        for i, op in enumerate(ops):
            if isinstance(op, Comm):
                start = i if start < 0 else start
                batch[(op.is_send, message(op))] = (start, op.peer)
            else:
                start = -1
                if isinstance(op, Action) and op.kind != "W":
                    at[(op.kind[0], op.stage, op.microbatch)] = i  # BW waits like B
        posted.append(batch)
        # a received message is waited for by its consumer: RECV_F(s) by F(s), RECV_B(s) by B or BW(s)
        consumer.append(
            {
                msg: at[("F", msg[1] + 1, msg[2]) if msg[0] == "F" else ("B", msg[1], msg[2])]
                for (send, msg) in batch
                if not send
            }
        )
    return tuple(_releases(r, lowered[r], posted, consumer) for r in range(len(lowered)))


def _releases(
    r: int,
    ops: Sequence[Op | object],
    posted: list[dict[tuple[bool, Message], tuple[int, int]]],
    consumer: list[dict[Message, int]],
) -> dict[int, tuple[tuple[Message, Message], ...]]:
    """:func:`send_releases` for rank ``r``."""
    computes = [i for i, op in enumerate(ops) if isinstance(op, Action)]
    earliest = {peer: _earliest_proofs(posted[peer], consumer[r], r) for peer in range(len(posted)) if peer != r}
    out: dict[int, list[tuple[Message, Message]]] = {}
    for (send, x), (at, peer) in posted[r].items():
        if not send:
            continue
        batches, best = earliest[peer]
        k = bisect.bisect_left(batches, posted[peer][(False, x)][0])  # proofs posted with the receive or later
        if k == len(batches):
            continue
        when, y = best[k]
        c = bisect.bisect_left(computes, max(when, at + 1))
        if c < len(computes):
            out.setdefault(computes[c], []).append((x, y))
    return {j: tuple(v) for j, v in sorted(out.items())}


def _earliest_proofs(
    sent: dict[tuple[bool, Message], tuple[int, int]], consumer: dict[Message, int], r: int
) -> tuple[list[int], list[tuple[int, Message]]]:
    """The messages a peer sends rank ``r`` by the batch it posts them in, ascending, and for each
    position the earliest receipt on ``r`` among those posted there or later (a suffix minimum)."""
    back = sorted((q, consumer[y], y) for (is_send, y), (q, to) in sent.items() if is_send and to == r)
    best: list[tuple[int, Message]] = []
    for _, when, y in reversed(back):
        best.append(min((when, y), best[-1]) if best else (when, y))
    return [q for q, _, _ in back], best[::-1]


def peak_inflight(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most (stage, micro-batch) pairs held from F until their last B/W/BW at once."""
    return tuple(int(n) for n in replay_memory(schedule, 1, 1).per_rank)  # unit costs: whole counts


def peak_activations(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most (stage, micro-batch) pairs held between F and B (or BW) at once.

    That is the Zero Bubble paper's M_B count, the one its memory budgets (and our greedy's F->B
    limits) bound; :func:`peak_inflight` holds a pair until its last B/W, the count that matters for
    this project's autograd split backward when a stage keeps its graph until W.
    """
    return tuple(int(n) for n in replay_memory(schedule, 1, 0).per_rank)  # unit costs: whole counts
