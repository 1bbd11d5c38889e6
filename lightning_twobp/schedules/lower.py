"""Lowering a schedule to compute + point-to-point communication, and checking the result.

:func:`lower_communication` inserts, on every rank,

* after each compute action its sends: ``F`` sends its output forward
  (``SEND_F``) when the next stage is on another rank; ``B``/``BW`` send the input
  gradient back (``SEND_B``) when the previous stage is on another rank;
* then the receives that the rank's next compute action needs: ``RECV_F`` before
  an ``F`` whose previous stage is remote, ``RECV_B`` before a ``B``/``BW`` whose
  next stage is remote (the receives of the first action open the list).

Stages adjacent on one rank exchange nothing: the executor hands the tensor over
locally.  A maximal run of consecutive :class:`Comm` ops is one *batch*, posted by
the executor as one ``torch.distributed.batch_isend_irecv``; this is how
``torch.distributed.pipelining``'s 1F1B puts a forward send and a backward receive
in one group so that NCCL does not deadlock.

Under strict rendezvous (a send completes only together with its receive) that
placement alone can deadlock when two ranks each send to the other before either
reaches the matching receive, e.g. GPipe on the loop map with 2 stages per rank on 2
ranks: rank 1 sends ``1F0`` to rank 0 (stage 2) while rank 0, still running stage 0
forwards, only receives it before ``2F0``.  The lowering therefore replays the
rendezvous and, whenever it would stick, hoists the blocked send's receive into the
batch where the receiving rank is waiting.  Receives stay as late as possible;
every hoisted receive's tensor has already been produced, so the executor never
waits on a future computation.  GPipe and 1F1B with one stage per rank need no
hoisting; ZB-H2 (deep warm-up), the loop map and the V do.

Why the repair always succeeds on a schedule that passes ``validate``: when the
replay sticks, if some rank waits on a send whose receive lies ahead of its peer,
hoisting applies; otherwise every stuck rank waits on a receive whose producer has
not run, at its original place right before its consumer (a hoisted receive's
sender is already parked at the matching send), and following those waits gives a
cycle of list order and data dependencies, i.e. a compute deadlock, which
``validate`` rules out.

Posting order (NCCL): NCCL ignores tags and matches the messages between two ranks
strictly in posting order, per direction.  On the loop and V maps two streams run
between the same pair of ranks in the same direction (e.g. activations of one chunk
and gradients of another), and the naive placement can post the receives in another
order than the sends, so a tensor would silently land in the wrong buffer.  The
lowering therefore also hoists receives: for each sender, a receive that the
receiving rank would post after the receive of a later-sent message moves up into
that message's batch, and inside a batch the receives from one peer are posted in
that peer's send order (:func:`check_comm_order` states the rule).  FIFO hoisting
and the rendezvous repair only ever move receives earlier, so alternating them until
neither moves anything terminates.  The rendezvous repair keeps FIFO order: the
receive it hoists is the one its sender is parked on, whose earlier messages to that
rank have all been matched already.  Sends are never moved, and a lowering that
already posts in order is left unchanged: of the built-in schedules only ZB-V needs
it (at unit costs, once it has more micro-batches than ranks); GPipe and interleaved
1F1B on the loop map happen to post in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .ir import Action, DeadlockError, Schedule, format_grid

COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class Comm:
    """One point-to-point op on the rank that holds ``stage``; ``peer`` is the other rank.

    * ``SEND_F(s, m)``: stage s sends its output for micro-batch m to stage s+1;
    * ``RECV_F(s, m)``: stage s receives its input from stage s-1;
    * ``SEND_B(s, m)``: stage s sends the gradient of its input to stage s-1;
    * ``RECV_B(s, m)``: stage s receives the gradient of its output from stage s+1.

    So ``SEND_F(s, m)`` pairs with ``RECV_F(s+1, m)`` and ``SEND_B(s, m)`` with
    ``RECV_B(s-1, m)``.  ``str`` follows the action notation: ``"2SEND_F0"``.
    """

    kind: str
    stage: int
    microbatch: int
    peer: int

    def __post_init__(self) -> None:
        if self.kind not in COMM_KINDS:
            raise ValueError(f"comm kind must be one of {COMM_KINDS}, got {self.kind!r}")

    @property
    def is_send(self) -> bool:
        return self.kind.startswith("SEND")

    @property
    def partner(self) -> tuple[str, int, int]:
        """(kind, stage, micro-batch) of the op this one pairs with."""
        direction = self.kind[-1]
        if self.is_send:
            stage = self.stage + 1 if direction == "F" else self.stage - 1
            return (f"RECV_{direction}", stage, self.microbatch)
        stage = self.stage - 1 if direction == "F" else self.stage + 1
        return (f"SEND_{direction}", stage, self.microbatch)

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.kind, self.stage, self.microbatch)

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


Op = Action | Comm


def lower_communication(schedule: Schedule) -> tuple[tuple[Op, ...], ...]:
    """Per rank: compute actions interleaved with the batches of sends and receives."""
    placement = schedule.stage_to_rank
    last = schedule.num_stages - 1

    def sends(action: Action, rank: int) -> list[Comm]:
        s, m = action.stage, action.microbatch
        if not isinstance(m, int):  # a batched W: no communication
            return []
        if action.kind == "F" and s < last and placement[s + 1] != rank:
            return [Comm("SEND_F", s, m, placement[s + 1])]
        if action.is_backward and s > 0 and placement[s - 1] != rank:
            return [Comm("SEND_B", s, m, placement[s - 1])]
        return []

    def recvs(action: Action, rank: int) -> list[Comm]:
        s, m = action.stage, action.microbatch
        if not isinstance(m, int):  # a batched W: no communication
            return []
        if action.kind == "F" and s > 0 and placement[s - 1] != rank:
            return [Comm("RECV_F", s, m, placement[s - 1])]
        if action.is_backward and s < last and placement[s + 1] != rank:
            return [Comm("RECV_B", s, m, placement[s + 1])]
        return []

    # Items alternate between compute actions and batches (lists of Comm); a batch
    # may be empty, which is dropped when flattening.
    items: list[list[Action | list[Comm]]] = []
    for rank, row in enumerate(schedule.actions):
        ranked: list[Action | list[Comm]] = [recvs(row[0], rank)] if row else []
        for i, action in enumerate(row):
            ranked.append(action)
            following = recvs(row[i + 1], rank) if i + 1 < len(row) else []
            ranked.append(sends(action, rank) + following)
        items.append(ranked)

    # FIFO hoisting and the rendezvous repair both only move receives earlier, so
    # alternating them until the FIFO pass moves nothing terminates.
    _fifo_hoist(items)
    _Rendezvous(items, repair=True).run()
    while _fifo_hoist(items):
        _Rendezvous(items, repair=True).run()
    _order_batches(items)
    return tuple(
        tuple(op for item in ranked for op in (item if isinstance(item, list) else [item])) for ranked in items
    )


def check_comm_deadlock(lowered: Sequence[Sequence[Op]], stage_to_rank: Sequence[int]) -> None:
    """Check a lowered schedule under strict rendezvous (the NCCL-like worst case).

    Each rank walks its list: compute completes when reached; a batch (maximal run of
    Comm ops) completes once every op in it has met its partner, and an op meets its
    partner only while the partner's rank is at the batch holding it.  Raises
    ValueError if an op sits on the wrong rank, names the wrong peer, or lacks
    exactly one partner, or if a pair of ranks posts its messages in an order NCCL
    would mismatch (see :func:`check_comm_order`); DeadlockError (with every rank's
    position) if it sticks.
    """
    seen: dict[tuple[str, int, int], int] = {}
    items: list[list[Action | list[Comm]]] = []
    for rank, row in enumerate(lowered):
        ranked: list[Action | list[Comm]] = []
        for op in row:
            if isinstance(op, Comm):
                if stage_to_rank[op.stage] != rank:
                    raise ValueError(f"rank {rank}: {op} belongs on rank {stage_to_rank[op.stage]}")
                partner_stage = op.partner[1]
                if not 0 <= partner_stage < len(stage_to_rank):
                    raise ValueError(f"rank {rank}: {op} has no stage {partner_stage} to pair with")
                if stage_to_rank[partner_stage] != op.peer:
                    raise ValueError(
                        f"rank {rank}: {op} names peer {op.peer} but stage {partner_stage} "
                        f"is on rank {stage_to_rank[partner_stage]}"
                    )
                if op.key in seen:
                    raise ValueError(f"rank {rank}: {op} appears twice")
                seen[op.key] = rank
                if ranked and isinstance(ranked[-1], list):
                    ranked[-1].append(op)
                else:
                    ranked.append([op])
            else:
                ranked.append(op)
        items.append(ranked)
    for key, rank in seen.items():
        partner = Comm(key[0], key[1], key[2], 0).partner
        if partner not in seen:
            raise ValueError(
                f"rank {rank}: {key[1]}{key[0]}{key[2]} has no matching {partner[1]}{partner[0]}{partner[2]}"
            )
    check_comm_order(lowered)
    _Rendezvous(items, repair=False).run()


def message(op: Comm) -> tuple[str, int, int]:
    """The message an op sends or receives: (direction ``F``/``B``, edge stage, micro-batch).

    The edge of a forward message is the sending stage (``SEND_F(s)``/``RECV_F(s+1)``:
    edge s), of a backward message the receiving stage (``SEND_B(s)``/``RECV_B(s-1)``:
    edge s-1), so an op and its partner name the same message.
    """
    direction = op.kind[-1]
    sender_names_it = (direction == "F") == op.is_send
    edge = op.stage if sender_names_it else op.stage - 1
    return (direction, edge, op.microbatch)


def check_comm_order(lowered: Sequence[Sequence[Op]]) -> None:
    """Check that every pair of ranks posts its messages in one order, per direction.

    NCCL ignores tags: the sends from rank A to rank B meet B's receives from A in
    the order each side posts them (list order; inside a batch, the batch's op
    order).  So for every directed pair A -> B the messages (:func:`message`) A sends
    to B must be, in order, the messages B receives from A.  Raises ValueError, not
    DeadlockError: a mismatch need not hang, it silently hands a tensor to the wrong
    buffer (or fails on a shape mismatch); the error names the pair and the first
    position where the two sequences differ.
    """
    sent: dict[tuple[int, int], list[Comm]] = {}
    received: dict[tuple[int, int], list[Comm]] = {}
    for rank, row in enumerate(lowered):
        for op in row:
            if isinstance(op, Comm):
                if op.is_send:
                    sent.setdefault((rank, op.peer), []).append(op)
                else:
                    received.setdefault((op.peer, rank), []).append(op)
    for src, dst in sorted(set(sent) | set(received)):
        sends, recvs = sent.get((src, dst), []), received.get((src, dst), [])
        for i in range(max(len(sends), len(recvs))):
            send = sends[i] if i < len(sends) else None
            recv = recvs[i] if i < len(recvs) else None
            if send is None or recv is None or message(send) != message(recv):
                raise ValueError(
                    f"rank {src} -> rank {dst}: message {i} is posted out of order (NCCL "
                    f"matches in posting order, ignoring tags): rank {src} sends "
                    f"{send if send is not None else 'nothing more'} but rank {dst} receives "
                    f"{recv if recv is not None else 'nothing more'}; sends "
                    f"{' '.join(map(str, sends))} vs receives {' '.join(map(str, recvs))}"
                )


def _sends_by_pair(items: list[list[Action | list[Comm]]]) -> dict[tuple[int, int], list[Comm]]:
    # Per (sender, receiver): the sender's sends to that receiver in posting order.
    out: dict[tuple[int, int], list[Comm]] = {}
    for rank, ranked in enumerate(items):
        for item in ranked:
            if isinstance(item, list):
                for op in item:
                    if op.is_send:
                        out.setdefault((rank, op.peer), []).append(op)
    return out


def _fifo_hoist(items: list[list[Action | list[Comm]]]) -> bool:
    """Move receives up so that each rank posts them in its peers' send order.

    Walking a sender's sends to one receiver backwards, a receive that sits in a
    later batch than the receive of some later-sent message moves up into the
    earliest such batch (a suffix minimum of batch indices).  Returns whether
    anything moved.  Order inside a batch is left to :func:`_order_batches`.
    """
    where: dict[tuple[str, int, int], tuple[int, int]] = {}
    for rank, ranked in enumerate(items):
        for index, item in enumerate(ranked):
            if isinstance(item, list):
                for op in item:
                    if not op.is_send:
                        where[message(op)] = (rank, index)
    moved = False
    for (_src, dst), sends in sorted(_sends_by_pair(items).items()):
        limit = None
        for send in reversed(sends):
            rank, index = where[message(send)]
            assert rank == dst, (send, rank, dst)
            if limit is not None and index > limit:
                batch, target = items[dst][index], items[dst][limit]
                assert isinstance(batch, list) and isinstance(target, list)  # `where` holds batch positions
                op = next(o for o in batch if not o.is_send and message(o) == message(send))
                batch.remove(op)
                target.append(op)
                where[message(send)] = (dst, limit)
                moved = True
            else:
                limit = index
    return moved


def _order_batches(items: list[list[Action | list[Comm]]]) -> None:
    """Inside each batch, post the receives from each peer in that peer's send order.

    The slots that receives from one peer occupy in the batch are refilled in send
    order; every other op keeps its place.
    """
    rank_of_send: dict[tuple[str, int, int], int] = {}
    for sends in _sends_by_pair(items).values():
        for i, send in enumerate(sends):
            rank_of_send[message(send)] = i
    for ranked in items:
        for item in ranked:
            if not isinstance(item, list):
                continue
            for peer in sorted({op.peer for op in item if not op.is_send}):
                slots = [i for i, op in enumerate(item) if not op.is_send and op.peer == peer]
                ops = sorted((item[i] for i in slots), key=lambda o: rank_of_send[message(o)])
                for i, op in zip(slots, ops, strict=False):
                    item[i] = op


class _Rendezvous:
    """Strict-rendezvous replay of per-rank items; optionally hoists receives to unstick."""

    def __init__(self, items: list[list[Action | list[Comm]]], repair: bool) -> None:
        self.items = items
        self.repair = repair
        self.where: dict[tuple[str, int, int], tuple[int, int]] = {}
        for rank, ranked in enumerate(items):
            for index, item in enumerate(ranked):
                if isinstance(item, list):
                    for op in item:
                        self.where[op.key] = (rank, index)
        self.pos = [0] * len(items)
        # Keys of the current batch's ops still waiting for their partner.
        self.pending: list[set[tuple[str, int, int]]] = [
            {op.key for op in ranked[0]} if ranked and isinstance(ranked[0], list) else set() for ranked in items
        ]

    def run(self) -> None:
        while True:
            for rank in range(len(self.items)):
                self._advance(rank)
            if all(p == len(r) for p, r in zip(self.pos, self.items, strict=False)):
                return
            if self._match():
                continue
            if self.repair and self._hoist():
                continue
            raise DeadlockError(self._report())

    def _advance(self, rank: int) -> None:
        # Compute completes when reached; a batch once all its ops have met partners.
        ranked = self.items[rank]
        while self.pos[rank] < len(ranked):
            if not self.pending[rank]:
                self.pos[rank] += 1
                item = ranked[self.pos[rank]] if self.pos[rank] < len(ranked) else None
                if isinstance(item, list):
                    self.pending[rank] = {op.key for op in item}
            else:
                return

    def _match(self) -> bool:
        matched = False
        for rank in range(len(self.items)):
            for key in sorted(self.pending[rank]):
                partner = Comm(*key, peer=0).partner
                if partner not in self.where:
                    continue
                peer, index = self.where[partner]
                if self.pos[peer] == index and partner in self.pending[peer]:
                    self.pending[rank].discard(key)
                    self.pending[peer].discard(partner)
                    matched = True
        return matched

    def _hoist(self) -> bool:
        # A blocked send whose receive lies ahead of the receiving rank: move that
        # receive into the batch the receiving rank is waiting in.
        for rank in range(len(self.items)):
            for key in sorted(self.pending[rank]):
                if not key[0].startswith("SEND"):
                    continue
                partner = Comm(*key, peer=0).partner
                peer, index = self.where[partner]
                here = self.pos[peer]
                if index <= here:
                    continue
                target = self.items[peer][here]
                if not isinstance(target, list):
                    continue
                old = self.items[peer][index]
                assert isinstance(old, list)  # `where` holds batch positions
                op = next(o for o in old if o.key == partner)
                old.remove(op)
                target.append(op)
                self.where[partner] = (peer, here)
                self.pending[peer].add(partner)
                return True
        return False

    def _report(self) -> str:
        cells = []
        lines = []
        for rank, ranked in enumerate(self.items):
            row = []
            for index, item in enumerate(ranked):
                if isinstance(item, list) and not item:
                    continue
                text = f"[{' '.join(str(o) for o in item)}]" if isinstance(item, list) else str(item)
                row.append(f">{text}<" if index == self.pos[rank] else text)
            cells.append(row)
            if self.pos[rank] < len(ranked):
                waiting = ", ".join(f"{s}{k}{m}" for k, s, m in sorted(self.pending[rank]))
                lines.append(f"rank {rank} stuck at item {self.pos[rank]} waiting on {waiting}")
            else:
                lines.append(f"rank {rank} finished")
        title = "communication deadlock under strict rendezvous (current batch marked >like this<)"
        return format_grid(title, cells) + "\n" + "\n".join(lines)
