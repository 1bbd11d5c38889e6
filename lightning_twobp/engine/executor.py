"""The executor: runs one rank's lowered action list over its stages.

A small dispatcher (style: torch.distributed.pipelining's runtime): the schedule says *what* and *when*,
:func:`lightning_twobp.schedules.lower_communication` adds the sends and receives, and this module only
maps each op kind to a handler. There is no schedule logic here.

Communication (:mod:`.p2p`): a run of consecutive comm ops is posted as one ``batch_isend_irecv``; a
compute op waits only for its own receives; adjacent stages on one rank hand tensors over without
communication. Nothing in a step waits on another rank except for data: consecutive steps overlap as
far as the schedule lets them (the first stage starts step n + 1's forwards while the last still runs
step n's W), which is what ZB-H2's and ZB-V's zero bubble needs.

Every action runs inside ``torch.profiler.record_function("PP:<action>")`` (``PP:1F3``, ``PP:0W0+1``),
so a profiler trace (Lightning's ``PyTorchProfiler`` included) shows the pipeline.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_twobp.engine import formulas
from lightning_twobp.engine.p2p import P2P, PeerLost, TensorMeta, check_outgoing
from lightning_twobp.engine.stage import Stage, carried_leaves
from lightning_twobp.own_generators import keep_generators
from lightning_twobp.private import pytree, saved_tensors_hooks_in_force
from lightning_twobp.schedules import Action, Comm, GradReduce, Schedule, add_grad_reduce, lower_communication, validate
from lightning_twobp.schedules.memory import send_releases

__all__ = ["ActionRecord", "PipelineError", "PipelineExecutor", "StepResult", "keep_buffers"]


# What to do when a stage's output changed whether it requires grad between steps (check_outgoing too).
_RESHAPE_HINT = (
    "a layer's requires_grad changed between steps on a rank that does not hold the first stage (a whole stage "
    "frozen or unfrozen while the stages before it were frozen), which changes what the stages exchange. Call "
    "reset_shapes() on every rank after such a change (trainer.strategy.reset_shapes() in the callback that "
    "makes it), or keep a parameter of the first stage trainable"
)


class PipelineError(RuntimeError):
    """An action failed; the message names the rank, the step and the action."""


@dataclass(frozen=True)
class ActionRecord:
    """One op as it ran: times in seconds from the step's start; ``wait`` is time blocked on receives."""

    rank: int
    step: int
    op: str
    start: float
    end: float
    wait: float = 0.0


@dataclass
class StepResult:
    """What one pipeline step returns on this rank."""

    loss: torch.Tensor | None  # mean over micro-batches; only on the rank holding the last stage
    losses: list[torch.Tensor] = field(default_factory=list)  # per micro-batch, unscaled
    records: list[ActionRecord] = field(default_factory=list)  # when ``record=True``
    held_bytes: dict[tuple[int, int], int] = field(default_factory=dict)  # (stage, mb) -> saved bytes


@dataclass
class _StepRun:
    """One step's state on this rank: made when :meth:`PipelineExecutor.step` starts, dropped when it
    returns, so nothing of a step outlives it on the executor."""

    inputs: list[tuple]  # stage 0's micro-batches (this rank holds stage 0), else empty
    targets: list[Any]  # the last stage's targets (this rank holds it), else empty
    loss_scale: float
    result: StepResult = field(default_factory=lambda: StepResult(loss=None))
    acts: dict[tuple[int, int], tuple] = field(default_factory=dict)  # (stage, mb) -> inputs handed over locally
    grads: dict[tuple[int, int], list] = field(default_factory=dict)  # (stage, mb) -> grads of its outputs
    to_send: dict[tuple[str, int, int], list[torch.Tensor]] = field(default_factory=dict)
    pending: list[Callable[[], None]] = field(default_factory=list)  # reduces started this step
    t0: float = 0.0  # the step's start (after the shape exchange)
    t0_event: Any = None  # its CUDA event, when recording on a GPU
    # CUDA events of recorded ops: (start, end, the (before, after) pairs around its receives' waits)
    events: list[tuple[Any, Any, list[tuple[Any, Any]]]] = field(default_factory=list)


class _WithLoss(nn.Module):
    """The last stage: the user's layers followed by the loss, so the stage's output is the loss."""

    def __init__(self, module: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn

    def forward(self, *inputs: Any, target: Any = None) -> torch.Tensor:
        return self.loss_fn(self.module(*inputs), target)


def keep_buffers(
    module: nn.Module, keep: Callable[[torch.Tensor], bool] = lambda b: True, attributes: bool = False
) -> Callable[[], None]:
    """A copy of ``module``'s buffers (those ``keep`` accepts) and the call that puts them back, each in its
    tensor and that tensor back in its place: a forward that rebinds a buffer (``self.ema = self.ema * d +
    ...``, ``self.calls = self.calls + 1``) instead of writing into it kept its own value, where the copy went
    into the tensor no longer registered (a trial: an EMA buffer 0.015 and every parameter up to 4e-4 off
    one process, its count one call too many). With ``attributes``, the public plain attributes of every
    submodule too (a Python counter ``self.calls += 1``, a flag, a value kept on the module): those added
    since are removed, the others rebound to what they were (a list or dict changed in place is not)."""
    saved = [
        (m, name, b, b.detach().clone())
        for m in module.modules()
        for name, b in m.named_buffers(recurse=False)
        if keep(b)
    ]
    # not for buffers_kept, at every post-validated step: no walk of every module's attributes there
    modules = list(module.modules()) if attributes else []
    plain = [(vars(m), {k: v for k, v in vars(m).items() if not k.startswith("_")}) for m in modules]
    generators = keep_generators(modules)  # a module's own generator (torchtune's LayerDropout) drew too

    def put_back() -> None:
        with torch.no_grad():
            for m, name, b, value in saved:
                if getattr(m, name, None) is not b:
                    setattr(m, name, b)
                b.copy_(value)
        for now, before in plain:
            for k in [k for k in now if not k.startswith("_") and k not in before]:
                del now[k]
            now.update(before)
        generators()

    return put_back


def _as_saved(t: torch.Tensor) -> torch.Tensor:
    """What autograd saved, as it was packed (no hooks in force around the recorded F)."""
    return t


def _as_tuple(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _detached(values: tuple, device: torch.device) -> tuple:
    """``values`` (tensors in tuples and lists) detached onto ``device``, each keeping its ``requires_grad``."""
    leaves, spec = carried_leaves(values)
    return pytree.tree_unflatten([t.detach().to(device).requires_grad_(t.requires_grad) for t in leaves], spec)


def _hint(e: BaseException) -> str:
    """The fix for a failure whose own message does not name it."""
    if "selective activation checkpoint has been mutated" in str(e):
        return (
            " (a block changes in place a matrix product's output that selective checkpointing keeps from F to B, "
            "as torch's LSTM with proj_size does on CPU; torch refuses it in one process too: checkpoint such "
            "blocks fully, activation_checkpointing='full' or a number, or not at all)"
        )
    return ""


def _refuse_packed(s: int, out: Any) -> None:
    """A stage that is not the last returning a PackedSequence (a named tuple of tensors): it would reach the next
    stage as a plain tuple of its fields (or, on the same rank, splatted into them), where its RNN fails on it."""
    if isinstance(out, torch.nn.utils.rnn.PackedSequence):
        raise TypeError(
            f"stage {s} returns a PackedSequence: only tensors and plain tuples of them travel between pipeline "
            f"stages, so the next stage would get a tuple of its fields and its RNN would fail on it. Unpack "
            f"it (torch.nn.utils.rnn.pad_packed_sequence) in the layer that ends the stage and pack again in "
            f"the next, as one layer that packs, runs the RNN and pads; or cut the stages elsewhere (under "
            f"strategy='twobp': balance=[...])"
        )


class PipelineExecutor:
    """Runs ``schedule`` on this rank.

    Args:
        schedule: a validated :class:`~lightning_twobp.schedules.Schedule`.
        modules: this rank's stage modules, ``{stage index: nn.Module}``.
        loss_fn: ``loss_fn(output, target) -> scalar``, applied on the last stage per micro-batch.
            The mean over micro-batches is what is differentiated (each micro-batch's loss / m).
        group: the pipeline's process group (default: the world); pipeline rank r is group rank r.
        device: where activations live (default: the device of the first parameter, else CPU).
        record: record each op's start/end and receive waits, and the bytes each micro-batch's F saves.
        grad_reduce: data parallelism: ``grad_reduce(stage, params)`` is called as soon as ``stage``'s
            gradients are complete (a pass places a :class:`GradReduce` after its last W), with every
            parameter of the stage that requires grad (``.grad`` None where this rank's micro-batches did not
            use it); it starts their reduce and returns a function that finishes it, called at the end of
            the step.
        timeout: seconds a rank waits on another before it reports that rank as lost (a
            :class:`PipelineError` naming its pipeline rank, stage and host); ``None``: the process
            group's own timeout (30 minutes by default).
        around: ``around(stage)`` gives a context manager entered around each F, B, W and BW of that
            stage and its forward-only passes (the strategy's per-stage random streams); the shape
            probe before a step runs outside it, so it leaves no trace there.
        batch_w: a W over several micro-batches joins each weight's call over them (``True``: where a
            micro-batch's output gradient at the op is at most :data:`formulas.BATCH_BYTES`; an int: that
            many bytes; ``Stage.batch_w_bytes``). Not bit-equal to one call per micro-batch (a joined sum).
        shape_group: a group of the same ranks, in the same order, for stage 0's input signature sent at each
            step's start (default: ``group``). On NCCL a group runs its operations in order, and on ``group``
            that send holds the step's first activations back until every peer has posted its receive.
    """

    def __init__(
        self,
        schedule: Schedule,
        modules: Mapping[int, nn.Module],
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        record: bool = False,
        grad_reduce: Callable[[int, list[nn.Parameter]], Callable[[], None]] | None = None,
        timeout: float | None = 600.0,
        around: Callable[[int], AbstractContextManager[Any]] | None = None,
        batch_w: bool | int = False,
        shape_group: dist.ProcessGroup | None = None,
    ) -> None:
        validate(schedule)
        self._around = around
        self.schedule = schedule
        self.group = group
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        if world != schedule.num_ranks:
            raise ValueError(
                f"schedule {schedule.name!r} has {schedule.num_ranks} ranks but the process group has "
                f"{world}: build the schedule with num_stages = {world} x stages_per_rank"
            )
        mine = set(schedule.stages_of(self.rank))
        if set(modules) != mine:
            raise ValueError(
                f"rank {self.rank} holds stages {sorted(mine)} in schedule {schedule.name!r}, "
                f"but modules were given for stages {sorted(modules)}"
            )
        self.last = schedule.num_stages - 1
        self.stages = {s: Stage(_WithLoss(m, loss_fn) if s == self.last else m) for s, m in modules.items()}
        for stage in self.stages.values():
            stage.batch_w_bytes = formulas.BATCH_BYTES if batch_w is True else int(batch_w)
        if batch_w and not schedule.joins_w:
            warnings.warn(
                f"batch_w={batch_w!r}: {schedule.name} runs each W alone here; nothing is joined", stacklevel=2
            )
        if device is None:
            first = next((p for m in modules.values() for p in m.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.record = record
        lowered: tuple[tuple[Action | Comm | GradReduce, ...], ...] = lower_communication(schedule)
        self._grad_reduce = grad_reduce
        if grad_reduce is not None:
            lowered = add_grad_reduce(lowered, schedule)
        self.ops = lowered[self.rank]
        # op index -> the sends this rank lets go of at the end of that op (their receives are posted)
        self._releases = send_releases(lowered)[self.rank]
        self._p2p = P2P(schedule, self.rank, group, self.device, timeout=timeout, shape_group=shape_group)
        # each stage's input structure (nested tuples and lists: a bare nn.LSTM's (out, (h, c))), learnt with the
        # shapes: its leaves travel, and the stage gets them rebuilt
        self._in_specs: dict[int, pytree.TreeSpec] = {}
        self.steps = 0  # steps run so far, counted from 0 in error messages
        self.step_label: str | None = None  # the caller's name for the next step in messages ("global step 7")
        self._handlers = {
            "F": self._forward,
            "B": self._backward_input,
            "W": self._backward_weight,
            "BW": self._backward,
        }
        self._now: _StepRun | None = None  # the step being run
        self._labels = [f"PP:{op}" for op in self.ops]

    @property
    def p2p(self) -> P2P:
        """This rank's sends and receives (the buffers of receives in flight: ``receive_buffers()``)."""
        return self._p2p

    def outgoing(self) -> list[torch.Tensor]:
        """What this rank holds to send during a step: made by an action and not posted yet, or posted
        and not let go of yet (:meth:`P2P.release`). For measuring memory; empty outside a step."""
        waiting = [t for ts in self._now.to_send.values() for t in ts] if self._now is not None else []
        return waiting + self._p2p.sending()

    def peer_lost(self, pp_rank: int, what: str, error: BaseException) -> PeerLost:
        """The error for a wait on pipeline rank ``pp_rank`` outside the schedule (the step's loss and logs)
        that failed with ``error``: named as the schedule's own waits name a lost rank."""
        return PeerLost(self._p2p.describe_loss([pp_rank], what, error))

    @property
    def _current(self) -> _StepRun:
        assert self._now is not None, "a handler ran outside step()"
        return self._now

    def reset_shapes(self) -> None:
        """Agree on the shapes between stages again before the next step. Needed (on every rank) only
        after a change made on one rank alone that alters what a stage sends (autocast, a parameter's
        ``requires_grad``); the first stage's input shapes are followed automatically."""
        self._p2p.forget_shapes()

    # ------------------------------------------------------------------ public
    def _which(self) -> str:
        return self.step_label or f"step {self.steps}"

    def step(
        self, inputs: Sequence[Any] | None = None, targets: Sequence[Any] | None = None, *, loss_scale: float = 1.0
    ) -> StepResult:
        """Run one iteration of the schedule: every micro-batch's F and backward, grads accumulated.

        ``inputs[mb]`` (a tensor or tuple of positional inputs) is needed on the rank holding stage 0,
        ``targets[mb]`` on the rank holding the last stage; other ranks pass ``None``. The gradients
        are those of ``loss_scale`` times the mean loss (a GradScaler's scale for fp16, so small
        gradients do not underflow on the way back).
        """
        m = self.schedule.num_microbatches
        for name, seq, stage in (("inputs", inputs, 0), ("targets", targets, self.last)):
            if stage in self.stages and (seq is None or len(seq) != m):
                got = "None" if seq is None else f"{len(seq)} items"
                raise ValueError(
                    f"rank {self.rank} holds stage {stage}: pass {name} as a sequence of {m} micro-batches (got {got})"
                )
        self._now = _StepRun(
            [_as_tuple(x) for x in inputs] if inputs is not None else [],
            list(targets) if targets is not None else [],
            float(loss_scale),
        )
        for st in self.stages.values():  # a step that failed part-way leaves micro-batches behind
            st.discard()
            st.follow_requires_grad()  # a layer frozen or unfrozen since the last step
        self._p2p.start_step()
        try:
            self._exchange_meta()
        except PeerLost as e:
            self._p2p.forget_shapes()
            raise PipelineError(f"rank {self.rank}, {self._which()}, before the first action: {e}") from e
        except BaseException:
            self._p2p.forget_shapes()
            raise
        run = self._now
        run.t0 = time.perf_counter()
        if self.record and self.device.type == "cuda":
            run.t0_event = torch.cuda.Event(enable_timing=True)
            run.t0_event.record()
        try:
            self._run_ops()
            self._p2p.finish_sends()
        except PeerLost as e:
            self._p2p.forget_shapes()
            raise PipelineError(f"rank {self.rank}, {self._which()}, after the last action: {e}") from e
        except BaseException:
            self._p2p.forget_shapes()
            raise
        finally:
            self.steps += 1
            self._now = None
        for finish in run.pending:
            finish()
        res = run.result
        if run.events:
            # On a GPU the host only launches kernels: times come from CUDA events, read once the
            # step's work has finished (one synchronisation per recorded step).
            torch.cuda.synchronize(self.device)
            res.records = [
                ActionRecord(
                    r.rank,
                    r.step,
                    r.op,
                    run.t0_event.elapsed_time(a) / 1e3,
                    run.t0_event.elapsed_time(b) / 1e3,
                    sum(x.elapsed_time(y) for x, y in waits) / 1e3,  # the device's stall, on its own clock
                )
                for r, (a, b, waits) in zip(res.records, run.events, strict=False)
            ]
        if self.last in self.stages:
            res.loss = torch.stack([x.detach() for x in res.losses]).mean()
        return res

    @torch.no_grad()
    def forward_only(self, inputs: Sequence[Any] | None, num_microbatches: int) -> list[Any] | None:
        """Evaluation: every micro-batch through every stage, no backward, nothing kept.

        Stage-major order (a GPipe forward) for one stage per rank and the V layouts (ZB-V, V-Half,
        V-Min): each rank runs its first stage over all micro-batches, then its next, so activations
        stream while nothing waits on a backward; in a V a rank sends only from its second stage, once
        its first has received everything. Elsewhere (interleaved 1F1B) that order deadlocks on the
        blocking sends, a ring of ranks each sending its first stage's next micro-batch while the last
        waits to send into a stage its receiver has not reached (p = 2: rank 0 sent stage 0's next
        micro-batch to rank 1 while rank 1 sent stage 1's first back, for stage 2); there the order is
        micro-batch-major: each micro-batch through the rank's stages in turn, one order of sends on
        every rank, at the price of less overlap. Shapes may differ between micro-batches (a last,
        smaller batch), so tensors travel after a header of their metadata (:meth:`P2P.send_tensors`:
        no pickling, 4-5x faster than ``send_object_list`` per message on gloo). Returns the last
        stage's outputs (its layers only, no loss) on the rank holding it, else None.
        """
        outs: list[Any] = []
        carry: dict[tuple[int, int], tuple] = {}
        ranks = self.schedule.stage_to_rank
        v_shape = all(ranks[s] == ranks[-1 - s] for s in range(len(ranks)))
        stages, mbs = sorted(self.stages), range(num_microbatches)
        if v_shape or len(stages) == 1:
            order = [(s, mb) for s in stages for mb in mbs]
        else:
            order = [(s, mb) for mb in mbs for s in stages]
        for s, mb in order:
            layers = self.stages[s].module
            layers = layers.module if isinstance(layers, _WithLoss) else layers
            if s == 0:
                assert inputs is not None  # the rank holding stage 0 passes them
                x = tuple(t.to(self.device) if isinstance(t, torch.Tensor) else t for t in _as_tuple(inputs[mb]))
            elif (s, mb) in carry:
                x = carry.pop((s, mb))
            else:
                x = self._p2p.recv_tensors(s - 1)
            try:
                with self._context(Action("F", s, mb)):
                    out = layers(*x)
            except Exception as e:
                raise PipelineError(
                    f"rank {self.rank}, forward-only pass, stage {s}, micro-batch {mb}: {type(e).__name__}: {e}"
                ) from e
            if s == self.last:
                outs.append(out)
                continue
            try:
                _refuse_packed(s, out)
            except TypeError as e:
                raise PipelineError(
                    f"rank {self.rank}, forward-only pass, stage {s}, micro-batch {mb}: TypeError: {e}"
                ) from e
            if s + 1 in self.stages:
                carry[(s + 1, mb)] = _as_tuple(out)
            else:
                self._p2p.send_tensors(_as_tuple(out), s + 1)
        return outs if self.last in self.stages else None

    # ------------------------------------------------------------------ dispatch
    def _run_ops(self) -> None:
        """Walk this rank's lowered list: a run of comm ops is one batch, every other op one handler."""
        ops, i = self.ops, 0
        while i < len(ops):
            op = ops[i]
            if isinstance(op, Comm):
                j = i
                while j < len(ops) and isinstance(ops[j], Comm):
                    j += 1
                self._run(i, self._post, list(ops[i:j]))
                i = j
            else:
                self._run(i, self._reduce if isinstance(op, GradReduce) else self._handlers[op.kind], op)
                i += 1

    def _run(self, step: int, handler: Callable, arg: Any) -> None:
        if self.record:
            start = time.perf_counter()
            self._p2p.wait_time = 0.0
            if self.device.type == "cuda":
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
                self._p2p.wait_events = []
        try:
            with torch.profiler.record_function(self._labels[step]), self._context(arg):
                handler(arg)
                if step in self._releases:  # inside: a memory sample at the context's exit sees it
                    self._p2p.release(self._releases[step])
        except BaseException as e:
            self._p2p.wait_events = None  # recorded op by op: a failed one's stay off
            if isinstance(e, PipelineError) or not isinstance(e, Exception):  # named already, or an interrupt
                raise
            # name the rank, the step and the action, then show where
            what = ", ".join(map(str, arg)) if isinstance(arg, list) else str(arg)
            raise PipelineError(
                f"rank {self.rank}, {self._which()}, op {step} ({what}): {type(e).__name__}: {e}{_hint(e)}\n"
                f"{self._listing(step)}"
            ) from e
        if self.record:
            if self.device.type == "cuda":
                ev[1].record()
                self._current.events.append((*ev, self._p2p.wait_events or []))
                self._p2p.wait_events = None
            label = "+".join(map(str, arg)) if isinstance(arg, list) else str(arg)
            self._current.result.records.append(
                ActionRecord(
                    self.rank,
                    step,
                    label,
                    start - self._current.t0,
                    time.perf_counter() - self._current.t0,
                    self._p2p.wait_time,
                )
            )

    def _context(self, op: Any) -> AbstractContextManager[Any]:
        return self._around(op.stage) if self._around is not None and isinstance(op, Action) else nullcontext()

    def _listing(self, at: int) -> str:
        cells = [f"  {i:3d} {op}" + ("   <-- ERROR HERE" if i == at else "") for i, op in enumerate(self.ops)]
        lo = max(0, at - 6)
        return f"rank {self.rank} ops (schedule {self.schedule.name!r}):\n" + "\n".join(cells[lo : at + 3])

    # ------------------------------------------------------------------ compute handlers
    def _stage_inputs(self, s: int, mb: int) -> tuple:
        if s == 0:
            return tuple(x.to(self.device) if isinstance(x, torch.Tensor) else x for x in self._current.inputs[mb])
        handed = (s, mb) in self._current.acts  # by stage s - 1 on this rank, else received
        leaves = self._current.acts.pop((s, mb)) if handed else self._p2p.wait(("F", s, mb))
        spec = self._in_specs.get(s)
        return tuple(pytree.tree_unflatten(list(leaves), spec)) if spec is not None else tuple(leaves)

    def _forward(self, a: Action) -> None:
        s, mb = a.stage, a.microbatch
        assert isinstance(mb, int)  # an F covers one micro-batch
        inputs = self._stage_inputs(s, mb)
        stage = self.stages[s]
        if s == self.last:
            target = self._current.targets[mb]
            kwargs = {"target": target.to(self.device) if isinstance(target, torch.Tensor) else target}
        else:
            kwargs = {}
        if self.record:
            # Bytes this micro-batch holds until its backward: the distinct storages autograd saves,
            # less the parameters (and views of them), which live anyway.
            weights = {q.untyped_storage().data_ptr() for q in stage.module.parameters()}
            storages: dict[int, int] = {}
            # Each tensor goes on to the hooks in force around the step (a user's save_on_cpu, a memory
            # meter), which autograd would otherwise skip on the recorded steps. Without any, a detached
            # alias: returning a saved output itself would make a reference cycle through its grad_fn
            # that keeps the whole graph alive.
            outer, unpack = saved_tensors_hooks_in_force() or (torch.Tensor.detach, _as_saved)

            def pack(t: torch.Tensor) -> Any:
                st = t.untyped_storage()
                if st.data_ptr() not in weights:
                    storages[st.data_ptr()] = st.nbytes()
                return outer(t)

            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                out = stage.forward(mb, *inputs, **kwargs)
            self._current.result.held_bytes[(s, mb)] = sum(storages.values())
        else:
            out = stage.forward(mb, *inputs, **kwargs)
        if s == self.last:
            self._current.result.losses.append(out.detach())  # the graph stays with the Stage until B
        elif s + 1 in self.stages:  # adjacent stage on this rank: hand over, no communication
            outs = tuple(carried_leaves(_as_tuple(out))[0])
            self._check_handed(s, mb, outs)
            self._current.acts[(s + 1, mb)] = outs
        else:
            outs = tuple(carried_leaves(_as_tuple(out))[0])
            check_outgoing(
                [TensorMeta.of(t) for t in outs],
                self._p2p.meta_out[s],
                f"the output stage {s} sends for micro-batch {mb}",
            )
            self._current.to_send[("F", s, mb)] = [t.detach() for t in outs]
            # The send holds the storage from here; B needs only the outputs' places in the graph.
            stage.drop_outputs(mb)

    def _check_handed(self, s: int, mb: int, outs: tuple) -> None:
        """Stage ``s + 1`` on this rank sends back gradients for the inputs that required grad when the
        shapes were agreed (``_hand_back``): an output whose ``requires_grad`` changed since (a layer of
        this rank frozen or unfrozen between steps, which only the first stage's rank sees) would have its
        gradient dropped, silently. Across ranks :func:`check_outgoing` refuses the same change."""
        if not torch.is_grad_enabled():
            return
        now = [t.requires_grad for t in outs]
        if now != [mt.requires_grad for mt in self._p2p.meta_in[s + 1]]:
            raise RuntimeError(
                f"the output stage {s} hands to stage {s + 1} for micro-batch {mb} requires grad {now}, but "
                f"{[mt.requires_grad for mt in self._p2p.meta_in[s + 1]]} when the shapes between stages were "
                f"agreed: {_RESHAPE_HINT}"
            )

    def _grad_outputs(self, s: int, mb: int) -> Any:
        if s == self.last:
            # d(mean loss)/d(loss_mb) = 1/m: the step differentiates the mean over micro-batches.
            loss = self._current.result.losses[-1]
            return torch.full_like(loss, self._current.loss_scale / self.schedule.num_microbatches)
        if (s, mb) in self._current.grads:
            return self._current.grads.pop((s, mb))
        return self._p2p.wait(("B", s, mb))

    def _hand_back(self, s: int, mb: int, grads: tuple) -> None:
        if s == 0:
            return
        # Only inputs that require grad travel back: the ones the previous stage's outputs required.
        metas = [mt for mt in self._p2p.meta_in[s] if mt.requires_grad]
        needed = [g for g, mt in zip(grads, self._p2p.meta_in[s], strict=False) if mt.requires_grad]
        if s - 1 in self.stages:
            self._current.grads[(s - 1, mb)] = needed
        else:
            check_outgoing(
                [TensorMeta(tuple(g.shape), g.dtype, True) for g in needed],
                metas,
                f"the input gradient stage {s} sends for micro-batch {mb}",
            )
            self._current.to_send[("B", s, mb)] = needed

    def _outside_autocast(self) -> AbstractContextManager[Any]:
        """B, W and BW run outside the forward's autocast, as ``loss.backward()`` runs after a training
        step's autocast region (Lightning's too): the step runs inside it, and autograd's engine applies
        the autocast state it is called under to the backward's own ops, so an fp32 matmul (under
        ``autocast(enabled=False)`` in the forward) had its input and weight gradients computed in bf16.
        A checkpointed block's recompute in B restores its forward's autocast state itself."""
        return torch.autocast(self.device.type, enabled=False)

    def _backward_input(self, a: Action) -> None:
        assert isinstance(a.microbatch, int)  # a B covers one micro-batch
        g = self._grad_outputs(a.stage, a.microbatch)
        with self._outside_autocast():
            grads = self.stages[a.stage].backward_input(a.microbatch, g)
        self._hand_back(a.stage, a.microbatch, grads)

    def _backward(self, a: Action) -> None:
        assert isinstance(a.microbatch, int)  # a BW covers one micro-batch
        g = self._grad_outputs(a.stage, a.microbatch)
        with self._outside_autocast():
            grads = self.stages[a.stage].backward(a.microbatch, g)
        self._hand_back(a.stage, a.microbatch, grads)

    def _backward_weight(self, a: Action) -> None:
        with self._outside_autocast():
            self.stages[a.stage].backward_weight(a.microbatches)

    def _reduce(self, op: GradReduce) -> None:
        # every trainable parameter, with a gradient or not: a replica whose micro-batches left one unused (a
        # mixture-of-experts' expert that got no token) must still take part, as DDP's find_unused_parameters
        # does; reduced by position, replicas passing their own sets summed one weight's gradient into another's
        params = [p for p in self.stages[op.stage].module.parameters() if p.requires_grad]
        assert self._grad_reduce is not None  # a GradReduce op is lowered only with grad_reduce
        self._current.pending.append(self._grad_reduce(op.stage, params))

    # ------------------------------------------------------------------ communication
    def _post(self, comms: list[Comm]) -> None:
        self._p2p.post(comms, self._current.to_send)

    # ------------------------------------------------------------------ shapes
    def _input_signature(self) -> int:
        """What the shapes between stages follow, as the rank holding stage 0 sees it: the micro-batches'
        shapes and dtypes, autocast, and its stages' training flags and trainable parameters."""
        parts: list[Any] = [
            [
                [(tuple(t.shape), str(t.dtype), t.requires_grad) for t in mb if isinstance(t, torch.Tensor)]
                for mb in self._current.inputs
            ],
            torch.is_autocast_enabled(self.device.type),
            str(torch.get_autocast_dtype(self.device.type)),
            [
                (s, st.module.training, [q.requires_grad for q in st.module.parameters()])
                for s, st in sorted(self.stages.items())
            ],
        ]
        return int(hashlib.sha1(repr(parts).encode()).hexdigest()[:15], 16)  # fits an int64

    def _exchange_meta(self) -> None:
        """Learn the shapes and dtypes between stages when they may have changed.

        The rank holding stage 0 sends its input signature to the others (:meth:`P2P.signature_changed`:
        a small message, no collective). When it changed, micro-batch 0 goes through the non-last stages
        once, on real data so data-dependent layers behave, with the RNG forked and buffers restored so
        that the step's numerics are those of a single process; each stage's output metadata travels to
        the next stage (receive buffers, made per message, follow it).
        """
        p2p = self._p2p
        if not p2p.signature_changed(self._input_signature() if 0 in self.stages else None):
            return
        p2p.new_shapes()
        s2r = self.schedule.stage_to_rank
        carry: tuple | None = None
        for s in range(self.schedule.num_stages - 1):
            if s2r[s] != self.rank:
                if s2r[s + 1] == self.rank:  # receive the previous stage's output (data and metadata)
                    carry = p2p.recv_object(s)
                    self._takes(s + 1, carry)
                continue
            if s == 0:
                inputs = self._stage_inputs(0, 0)
                p2p.meta_in[0] = [TensorMeta.of(t) for t in inputs if isinstance(t, torch.Tensor)]
            else:
                assert carry is not None  # stage s - 1's output, received or computed above
                inputs = _detached(carry, self.device)
            try:
                out = self._probe(s, inputs)
            except Exception as e:
                raise PipelineError(
                    f"rank {self.rank}, {self._which()}, shape exchange before the first action, stage {s} on "
                    f"micro-batch 0: "
                    f"{type(e).__name__}: {e}"
                ) from e
            p2p.meta_out[s] = [TensorMeta.of(t) for t in carried_leaves(out)[0]]
            carry = _detached(out, self.device)
            if s2r[s + 1] == self.rank:
                self._takes(s + 1, carry)
            else:
                p2p.send_object(_detached(out, torch.device("cpu")), s + 1)

    def _takes(self, s: int, carry: tuple) -> None:
        """Stage ``s``'s input, as the shape exchange carried it: each leaf's metadata and the structure."""
        leaves, self._in_specs[s] = carried_leaves(carry)
        self._p2p.meta_in[s] = [TensorMeta.of(t) for t in leaves]

    def _probe(self, s: int, inputs: tuple) -> tuple:
        """Stage ``s``'s forward for its output metadata only: leaves no trace in RNG or buffers
        (dropout draws, BatchNorm running statistics)."""
        module = self.stages[s].module
        put_back = keep_buffers(module, attributes=True)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            out = _as_tuple(module(*inputs))
        put_back()
        _refuse_packed(s, out)
        bad = [type(x).__name__ for x in carried_leaves(out)[0] if not isinstance(x, torch.Tensor)]
        if bad:
            raise TypeError(
                f"stage {s} returns {bad}: values passed between pipeline stages must be tensors, or tuples "
                f"and lists of them (nested too, as a bare nn.LSTM's (out, (h, c))); move non-tensor values "
                f"into the stage that uses them"
            )
        return out
