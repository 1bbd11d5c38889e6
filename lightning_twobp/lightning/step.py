"""Running the user's ``training_step`` (or ``validation_step`` ...) once per micro-batch.

On the rank holding the first stage the step runs up to the pipelined block's call, whose inputs are
*captured* (the step stops there); on the rank holding the last stage it runs whole, with the call
*provided* the pipeline's output, so the loss, metrics and ``self.log`` happen there, per micro-batch.
``self.log`` is recorded during each micro-batch (the first stage's calls, before the block, are
dropped: the last stage logs them again) and the values reach Lightning once per step through
:func:`share_logs`: a mean over micro-batches weighted by their sizes, on every rank of the pipeline.
A logged torchmetrics ``Metric`` is recorded by reference instead: its state accumulates the step's
micro-batches and each rank logs its own copy (:mod:`.metrics`).

Everything that lives for one step is in one :class:`StepState`.
"""

from __future__ import annotations

import functools
import operator
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_twobp.lightning.contract import Contract
from lightning_twobp.lightning.local_model import is_placeholder
from lightning_twobp.lightning.metrics import MetricRef, States, StepMetrics, is_metric, raising
from lightning_twobp.lightning.placeholders import ElsewhereError, find_elsewhere
from lightning_twobp.lightning.rng import StageStreams, drawing_from

__all__ = [
    "DP_GROUP",
    "StepRunner",
    "StepState",
    "check_batch_size",
    "check_batches",
    "log_step_values",
    "placeholder_holders",
    "shadowed",
    "share_logs",
    "split_microbatches",
    "step_means",
]

Logs = dict[str, tuple[Any, dict]]  # name -> (value, self.log's keyword options)

# self.log's ``sync_dist_group`` for a value synchronised over the data-parallel replicas: a name, not the
# group, since each Trainer call builds new process groups and Lightning keeps a key's options from one
# call to the next (a second ``validate`` on one Trainer raised "You called self.log(val_loss, ...) twice
# ... with different arguments"); ``TwoBPStrategy.reduce`` reduces over the group it names.
DP_GROUP = "twobp:data-parallel"


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors in ``batch``, walked as Lightning walks a batch to move it to the device (dicts,
    Mappings such as Hugging Face's ``BatchEncoding``, sequences, namedtuples, dataclasses)."""
    found: list[torch.Tensor] = []
    apply_to_collection(batch, torch.Tensor, found.append)
    return found


def split_microbatches(batch: Any, m: int, exact: bool = True) -> list[Any]:
    """``batch`` cut along its first dimension into ``m`` micro-batches: equal ones for training
    (``exact``); evaluation takes a smaller last batch as up to ``m`` nearly equal pieces. The batch is
    walked as Lightning walks it to move it to the device, so a Mapping that is not a dict (Hugging
    Face's ``BatchEncoding``) or a dataclass is cut too and keeps its type."""
    sizes = {x.shape[0] for x in batch_tensors(batch) if x.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(
            f"cannot split the batch into micro-batches: its tensors have first dimensions {sorted(sizes)}; "
            f"every tensor in the batch needs the same batch dimension first"
            + ("" if sizes else f" (found no tensor in a batch of type {type(batch).__name__})")
        )
    (n,) = sizes
    if exact and n % m:
        raise ValueError(
            f"batch size {n} does not split into {m} micro-batches: use a batch size that is a multiple "
            f"of {m}, or set num_microbatches to a divisor of {n}; where it is a smaller last batch (a loader "
            f"whose length is not known before training, over an IterableDataset, is checked batch by batch), "
            f"pass drop_last=True to the DataLoader or make the sample count a multiple of {m}"
        )
    m = min(m, n)
    pieces: dict[int, tuple[torch.Tensor, ...]] = {}
    bounds = [k * (n // m) + min(k, n % m) for k in range(m + 1)]  # tensor_split's: the first n % m one longer

    def piece(x: Any, i: int) -> Any:
        if isinstance(x, list):  # a list of one value per sample (a text batch's strings, ids) is cut too
            return x[bounds[i] : bounds[i + 1]] if len(x) == n and _flat(x) else [_cut(e, piece, i) for e in x]
        if x.dim() == 0:
            return x
        if id(x) not in pieces:
            pieces[id(x)] = x.tensor_split(m)
        return pieces[id(x)][i]

    return [_cut(batch, piece, i) for i in range(m)]


def _cut(batch: Any, piece: Callable[[Any, int], Any], i: int) -> Any:
    return apply_to_collection(batch, (torch.Tensor, list), piece, i)


def _flat(x: Any) -> bool:
    return isinstance(x, list) and not any(isinstance(e, (torch.Tensor, list, tuple, dict)) for e in x)


def join_predictions(results: list[Any], sizes: list[int] | None = None) -> Any:
    """The micro-batches' ``predict_step`` outputs as the batch's, the inverse of :func:`split_microbatches`:
    per-sample tensors concatenated, per-sample lists joined, containers entry by entry, and a value every
    micro-batch returned alike (a batch index, None) kept once. Anything else is refused, naming it.
    ``sizes``: each micro-batch's samples, which tell a list of one tensor per sample (refused) from a list of
    outputs."""
    first = results[0]
    if isinstance(first, torch.Tensor) and first.dim() > 0 and _rows_per_sample(results, sizes):
        return torch.cat(results)
    if all(_flat(r) for r in results):
        return [e for r in results for e in r]
    _refuse_rows(results, sizes)
    if isinstance(first, dict) and all(isinstance(r, dict) and r.keys() == first.keys() for r in results):
        return _like(first, {k: join_predictions([r[k] for r in results], sizes) for k in first})
    if type(first) in (list, tuple) and all(type(r) is type(first) and len(r) == len(first) for r in results):
        return type(first)(join_predictions(list(col), sizes) for col in zip(*results, strict=True))
    same = all(
        torch.equal(r, first) if isinstance(first, torch.Tensor) and isinstance(r, torch.Tensor) else r == first
        for r in results
    )
    if same:
        return first
    raise ValueError(
        f"predict_step returned a {type(first).__name__} that differs between the micro-batches of one batch "
        f"({results[0]!r:.60} and {results[-1]!r:.60}): under strategy='twobp' it runs once per micro-batch, and "
        f"only per-sample values (tensors whose first dimension is the batch, lists of one entry per sample) "
        f"join into the batch's; return those, or compute a value of the whole batch from them afterwards"
    )


def _like(first: dict, joined: dict) -> dict:
    """``joined`` as ``first``'s kind of dict: a Hugging Face ``ModelOutput`` stays one (``out.logits``)."""
    if type(first) is dict:
        return joined
    try:
        return type(first)(**joined)
    except TypeError:  # a mapping not made from keywords
        return joined


def _rows_per_sample(results: list[Any], sizes: list[int] | None) -> bool:
    """Tensors with a row per sample of their micro-batch (joined along it); not a value of the whole micro-batch
    (an embedding of shape (5,) every micro-batch returns: kept once where alike, else refused)."""
    if sizes is None:
        return True
    pairs = zip(results, sizes, strict=True)
    return all(isinstance(r, torch.Tensor) and r.dim() > 0 and r.shape[0] == n for r, n in pairs)


def _refuse_rows(results: list[Any], sizes: list[int] | None) -> None:
    """Refuse a list of one tensor per sample (``[row for row in out]``: as long as its micro-batch, its tensors
    alike), which would join as a list of outputs, each micro-batch's rows as columns (silently: 2 tensors of 8
    where one process has 8 rows); as one tensor per sample it cannot be told from a list of outputs alike."""
    if sizes is None or not all(type(r) is list and len(r) == n for r, n in zip(results, sizes, strict=True)):
        return
    entries = [e for r in results for e in r]
    if not entries or not all(isinstance(e, torch.Tensor) and e.shape == entries[0].shape for e in entries):
        return
    raise ValueError(
        f"predict_step returned a list of {sizes[0]} tensors of shape {tuple(entries[0].shape)} for a micro-batch "
        f"of {sizes[0]} samples: under strategy='twobp' it runs once per micro-batch, and a list as long as the "
        f"micro-batch reads as one tensor per sample or as one entry per output alike; torch.stack the samples' "
        f"rows into one tensor (joined along the batch), or return a tuple (or a dict) for several outputs"
    )


def check_batch_size(size: int, m: int) -> None:
    """A training batch of ``size`` samples splits into ``m`` equal micro-batches."""
    if size < m:
        raise ValueError(
            f"the training batch size {size} is smaller than num_microbatches={m}: every micro-batch "
            f"needs a sample; use a batch size of at least {m} (a multiple of it), or fewer micro-batches"
        )
    if size % m:
        raise ValueError(
            f"training batch size {size} does not split into {m} micro-batches: use a batch size that "
            f"is a multiple of {m}, or set num_microbatches to a divisor of {size}"
        )


def check_batches(loader: Any, m: int) -> None:
    """Before the first training step: every batch the training ``loader`` will yield splits into ``m``
    equal micro-batches, the last one included. Loaders whose sizes cannot be known are checked batch
    by batch instead (:func:`split_microbatches`)."""
    size = getattr(loader, "batch_size", None)
    if not isinstance(size, int):
        return
    check_batch_size(size, m)
    try:
        samples = len(loader.sampler)
    except (TypeError, AttributeError):
        return
    last = samples % size
    if not getattr(loader, "drop_last", True) and last % m:
        raise ValueError(
            f"the training set's last batch holds {last} samples ({samples} samples in batches of "
            f"{size}), which do not split into {m} micro-batches: pass drop_last=True to the training "
            f"DataLoader (or a sample count that is a multiple of {m})"
        )


def check_batch_size_early(trainer: Any, m: int) -> None:
    """The sanity check runs before Lightning loads the training data. A training loader given to the
    Trainer call whose batch size cannot split into micro-batches is refused before its first validation
    step. One that a ``train_dataloader()`` hook makes is checked when training starts, with the last
    batch (:func:`check_batches`): calling the hook here too would call it once more than one process does,
    and a hook that hands out the next shard, or counts its calls, would then train on other data."""
    from lightning_twobp.private import data_source

    source = data_source(trainer.fit_loop)
    if source is None or source.is_module():
        return
    loader = source.dataloader()  # the instance itself: no hook runs
    size = getattr(loader, "batch_size", None)
    if isinstance(size, int):
        check_batch_size(size, m)


def batch_size(batch: Any) -> int:
    leaves = [x for x in batch_tensors(batch) if x.dim() > 0]
    return leaves[0].shape[0] if leaves else 1


@dataclass
class StepState:
    """One step: which hook, its extra arguments, the micro-batches and what each logged."""

    hook: str  # "training_step", "validation_step", "test_step" or "predict_step"
    args: tuple  # the hook's arguments after the batch (batch_idx, dataloader_idx)
    kwargs: dict
    microbatches: list[Any]
    sizes: list[int]  # each micro-batch's samples
    key: str = ""  # the step, as every rank of the pipeline names it: its random draws' seed (rng.step_code)
    logs: list[Logs] = field(default_factory=list)
    results: list[Any] = field(default_factory=list)  # what the hook returned, per micro-batch (last stage)
    losses: list[torch.Tensor] = field(default_factory=list)  # training: each micro-batch's loss, detached


class _Captured(Exception):
    """Raised by the intercepted block on the first stage to stop the step at its inputs."""

    def __init__(self, inputs: tuple) -> None:
        super().__init__("captured")
        self.inputs = inputs


def _no_collective(hook: str) -> Callable[..., Any]:
    return raising(
        f"self.all_gather in {hook} under strategy='twobp': the step runs once per micro-batch, on the "
        f"pipeline's ranks at different times (the first stage's part before the pipeline starts, the last "
        f"stage's inside it), so a collective there would wait forever; gather where every rank runs at once "
        f"(on_train_batch_end, on_validation_epoch_end), or log with self.log(..., sync_dist=True)",
        RuntimeError,
    )


@contextmanager
def shadowed(shadows: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Inside: each ``(obj, name, value)`` as an instance attribute of ``obj``, shadowing its method ``name``
    for this call only; what was there before (nothing, or an instance attribute of its own: a torchmetrics
    Metric's wrapped ``update``) is back afterwards, also when the call raises."""
    before = [(obj, name, obj.__dict__.get(name, _NOTHING)) for obj, name, _ in shadows]
    for obj, name, value in shadows:
        obj.__dict__[name] = value
    try:
        yield
    finally:
        for obj, name, value in reversed(before):
            if value is _NOTHING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = value


_NOTHING = object()


def _no_scheduler_step(lm: Any, hook: str, m: int) -> list[tuple[Any, str, Any]]:
    """The LR schedulers of ``configure_optimizers`` refuse ``step()`` while ``hook`` runs: the step's code runs
    once per micro-batch, on the first stage and again on the last, so ``self.lr_schedulers().step()`` there
    stepped each rank's scheduler ``m`` times per batch (found by a trial: the rate after 3 steps was 0.5**12
    of the start, not 0.5**3, silently). The shadows of their ``step`` (see :func:`shadowed`)."""
    trainer = getattr(lm, "_trainer", None)
    configs = trainer.lr_scheduler_configs if trainer is not None else []

    refuse = raising(
        f"self.lr_schedulers().step() in {hook} under strategy='twobp': the step's code runs once per "
        f"micro-batch ({m} per batch), on the first pipeline stage and again on the last, so each rank's "
        f"scheduler would step {m} times per batch, not once; step it where every rank runs once per batch "
        f"(on_train_batch_end), or let Lightning step it (interval='step' in configure_optimizers)",
        RuntimeError,
    )
    return [(c.scheduler, "step", refuse) for c in configs if hasattr(c.scheduler, "__dict__")]


class _LogRecorder:
    """Stands in for ``LightningModule.log`` during one micro-batch: records instead of logging."""

    def __init__(self, store: Logs | None, metrics: StepMetrics, hook: str, m: int) -> None:
        self.store = store
        self.metrics = metrics
        self.hook, self.m = hook, m

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if self.store is None:  # first stage, before the block: the last stage logs it
            return
        if args:
            raise TypeError("pass self.log options by keyword under strategy='twobp'")
        if reduction(kwargs) not in ("mean", "sum", "max", "min"):
            raise ValueError(
                f"self.log({name!r}, ..., reduce_fx={kwargs['reduce_fx']!r}): Lightning reduces logged values by "
                f"mean, sum, max or min only; for a custom reduction log a torchmetrics Metric instead"
            )
        elsewhere = find_elsewhere(value)
        if elsewhere is not None:
            raise ElsewhereError(
                f"self.log({name!r}, ...) from a step under strategy='twobp' logs a value computed by "
                f"{elsewhere.where}, which this rank does not hold: the step's code after the pipelined call runs "
                f"on the last stage only, where the layers of other stages have no weights; log such a value from "
                f"a hook (on_train_batch_end, on_validation_epoch_end) on the rank whose trainer.strategy.stage_ids "
                f"hold that layer"
            )
        if is_metric(value):
            value = self.metrics.ref(value, name)
        self._tell_extreme(name, value, reduction(kwargs))
        if not isinstance(value, (torch.Tensor, int, float, MetricRef)):
            raise TypeError(
                f"self.log({name!r}, {type(value).__name__}) from a step under strategy='twobp': log a tensor, a "
                f"number or a torchmetrics Metric; see docs/strategy.md, 'Logging and metrics'"
            )
        self.store[name] = (value.detach() if isinstance(value, torch.Tensor) else value, kwargs)

    def _tell_extreme(self, name: str, value: Any, how: str) -> None:
        """Warn once a Trainer call where a floating number is logged with ``reduce_fx`` sum, max or min: the
        step's value is the micro-batches' sum or extreme (:func:`step_means`), one process's for a count or an
        extreme over the batch's samples, not for a mean such as the loss (found by a trial: an epoch's max of
        the loss read the worst micro-batch's mean, 2.56 against one process's 1.60)."""
        floating = isinstance(value, float) or (isinstance(value, torch.Tensor) and value.is_floating_point())
        if how == "mean" or not floating or self.m == 1 or not self.metrics.first_time(f"log:{name}"):
            return
        fix = (
            "log the batch's loss in on_train_batch_end (outputs['loss'], on every rank) with that reduce_fx"
            if self.hook == "training_step"
            else "log a value the micro-batches' sum or extreme gives whole (a count, the largest sample's loss)"
        )
        warnings.warn(
            f"twobp: self.log({name!r}, ..., reduce_fx={how!r}) in {self.hook}, which runs once per micro-batch "
            f"({self.m} per batch): the step logs the {self.m} values' {how}, one process's value for a count or an "
            f"extreme over the batch's samples, not for a mean such as the loss (its {how} over micro-batches is "
            f"not the batch's mean); for such a mean, {fix}",
            stacklevel=3,
        )


def _autocast_state(module: Any) -> tuple[tuple[str, bool, str], ...]:
    """Whether autocast is on, and its dtype, for the CPU and the module's device type."""
    device = getattr(module, "device", torch.device("cpu"))
    kinds = dict.fromkeys(("cpu", device.type if isinstance(device, torch.device) else "cpu"))
    kinds = {k: None for k in kinds if torch.amp.is_autocast_available(k)}  # not "meta" (twobp-plan's model)
    on = {k: torch.is_autocast_enabled(k) for k in kinds}  # the dtype counts only where it is on
    return tuple((k, on[k], str(torch.get_autocast_dtype(k)).removeprefix("torch.") if on[k] else "") for k in kinds)


def _same_autocast(hook: str, name: str, outside: tuple, inside: tuple) -> None:
    """Refuses a step that enters or leaves ``torch.autocast`` around the pipelined call: the pipeline runs
    the block's layers in the Trainer's precision context, not inside the step's code, so the step's own
    autocast would be dropped silently (the layers computed in fp32 where one process computes in bf16)."""
    if inside == outside:
        return

    def said(state: tuple) -> str:
        return ", ".join(f"{k} {dtype if on else 'off'}" for k, on, dtype in state)

    raise ValueError(
        f"{hook} changes torch.autocast around its call of {name} (autocast there: {said(inside)}; in the "
        f"Trainer's precision context: {said(outside)}): under strategy='twobp' the pipeline runs the layers of {name} "
        f"in the Trainer's precision context, not inside {hook}, so that autocast would be ignored; use "
        f"Trainer(precision='bf16-mixed') (or '16-mixed'), or enter torch.autocast inside the layers' own forward"
    )


class StepRunner:
    """Calls a LightningModule's step hook per micro-batch with the pipelined block intercepted."""

    def __init__(self, module: Any, contract: Contract, metrics: StepMetrics) -> None:
        self.module = module
        self.contract = contract
        self.metrics = metrics
        self.state: StepState | None = None
        self._told_extra = False  # the warning about a training_step's keys beside "loss", once a run
        self._told_dropped: set[str] = set()  # the hooks whose returned values were said to be dropped
        # The pipeline's random streams once it is built: the step's code before the pipelined call draws
        # alike on every stage (None while profiling, before the pipeline exists).
        self.streams: StageStreams | None = None
        # The modules holding placeholders of other ranks' layers, once the model is split (none before):
        # found once, not per micro-batch (a walk of every module: 0.27 ms on a 32-block Llama).
        self.holders: list[tuple[str, Any]] = []
        contract.bind(self)  # the ModuleList contract's later stages re-run the step's capture through it

    def begin(self, hook: str, args: tuple, kwargs: dict, m: int, exact: bool) -> StepState:
        batch, rest = args[0], args[1:]
        micro = split_microbatches(batch, m, exact)
        self.state = StepState(hook, rest, kwargs, micro, [batch_size(mb) for mb in micro], key=self._key(hook, rest))
        return self.state

    def _key(self, hook: str, rest: tuple) -> str:
        """The step as every rank names it alike and a resumed run names it again: the hook, the trainer's
        global step and epoch, and the hook's integer arguments (batch_idx, dataloader_idx)."""
        trainer = getattr(self.module, "_trainer", None)
        where = (trainer.global_step, trainer.current_epoch) if trainer is not None else (0, 0)
        return f"{hook}:{where}:{[a for a in rest if isinstance(a, int)]}"

    @property
    def current(self) -> StepState:
        """The state of the step under way (set by :meth:`begin`)."""
        assert self.state is not None, "no step has begun"
        return self.state

    def _call(self, index: int, block: Callable[..., Any], logs: Logs | None) -> Any:
        state = self.current
        recorder = _LogRecorder(logs, self.metrics, state.hook, len(state.microbatches))
        outside = _autocast_state(self.module)
        with self._drawing_alike(index) as hand_back:

            def call(*args: Any, **kwargs: Any) -> Any:
                _same_autocast(state.hook, self._name, outside, _autocast_state(self.module))
                hand_back()  # the block and what follows it draw from the stage's own stream
                return block(*args, **kwargs)

            return self._call_hook(state, index, call, recorder)

    def _drawing_alike(self, index: int) -> AbstractContextManager[Callable[[], None]]:
        """Micro-batch ``index``'s step code up to the pipelined call draws the same random numbers on every
        stage (:meth:`.rng.StageStreams.step_code`): mixup's lambda mixes the first stage's inputs and the
        last stage's targets alike."""
        if self.streams is None:  # profiling, before the pipeline exists: its draws leave no trace
            return drawing_from(None, [])
        return self.streams.step_code(f"{self.current.key}:mb{index}")

    def _call_hook(self, state: StepState, index: int, block: Callable[..., Any], recorder: _LogRecorder) -> Any:
        lm = self.module
        # For this call only: ``self.log`` answered by the recorder; the Metrics' updates as one process's
        # (StepMetrics.step_shadows); ``self.all_gather``, the schedulers' ``step`` and whole-model parameter
        # reads refused.
        shadows = [(lm, "log", recorder), (lm, "all_gather", _no_collective(state.hook))]
        shadows += self.metrics.step_shadows(state.hook, len(state.sizes), state.sizes[index] / sum(state.sizes))
        shadows += _no_scheduler_step(lm, state.hook, len(state.microbatches))
        shadows += _no_whole_model_reads(self.holders, state.hook)
        with self.contract.intercept(block), shadowed(shadows):
            return getattr(lm, state.hook)(state.microbatches[index], *state.args, **state.kwargs)

    def capture(self, index: int) -> tuple:
        """The pipelined block's positional inputs for micro-batch ``index`` (first stage)."""

        def block(*inputs: Any, **kwargs: Any) -> Any:
            if kwargs:
                raise TypeError(
                    f"{self._name} was called with keyword arguments {sorted(kwargs)}: an nn.Sequential takes "
                    f"one positional input"
                )
            raise _Captured(inputs)

        try:
            self._call(index, block, None)
        except _Captured as c:
            inputs = c.inputs
        else:
            raise RuntimeError(
                f"{self.current.hook} did not call {self._name}: under strategy='twobp' it must call the pipelined "
                f"block exactly once (when another module's forward calls it, point layers= at a Sequential "
                f"that {self.current.hook} calls itself)"
            )
        for x in inputs:
            if isinstance(x, torch.Tensor) and x.requires_grad:
                raise ValueError(
                    f"the input of {self._name} requires grad: a module with parameters runs before it in "
                    f"{self.current.hook}, which the pipeline cannot train; move it into the Sequential"
                )
        return inputs

    def provide(self, index: int, output: Any) -> Any:
        """Run the hook on micro-batch ``index`` with the block answered by ``output`` (last stage);
        record its logs and return what the hook returned."""
        logs: Logs = {}
        result = self._call(index, lambda *a, **k: output, logs)
        self.current.logs.append(logs)
        self.current.results.append(result)
        return result

    def loss(self, output: Any, index: int) -> torch.Tensor:
        """The executor's ``loss_fn``: the training step on micro-batch ``index`` returns the loss."""
        out = self.provide(index, output)
        loss = out.get("loss") if isinstance(out, dict) else out
        elsewhere = find_elsewhere(loss)
        # Its backward made placeholder gradients, which the send to the previous stage cannot carry: every
        # rank waited forever (found by a trial: an L1 penalty of the first stage's weight in the loss).
        if elsewhere is not None:
            raise ElsewhereError(_loss_elsewhere(self.current.hook, elsewhere.where))
        if loss is None:  # one process skips the batch's backward and optimizer step
            raise TypeError(
                f"{self.current.hook} returned None on micro-batch {index}, which skips the batch in one process: "
                f"under strategy='twobp' the schedule runs every micro-batch's backward, so a step cannot skip "
                f"its batch (nor one micro-batch); return the loss. To skip a non-finite step on every rank use "
                f"TwoBPStrategy(on_nonfinite='skip'); to drop samples, filter them in the data or weigh their "
                f"loss by 0"
            )
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"{self.current.hook} returned {type(out).__name__} on micro-batch {index}: under strategy='twobp' "
                f"it must return the loss tensor (or a dict with 'loss')"
            )
        if isinstance(out, dict) and len(out) > 1 and not self._told_extra:
            self._told_extra = True
            warnings.warn(_extra_keys(self.current.hook, sorted(k for k in out if k != "loss")), stacklevel=2)
        self.current.losses.append(loss.detach())
        return loss

    def say_dropped(self) -> None:
        """On the last stage, after an evaluation step: a ``validation_step`` or ``test_step`` that returned
        something (Lightning hands it to ``on_validation_batch_end`` as ``outputs``) is told, once a run, that
        the pipeline does not carry it: ``outputs`` is None there on every rank. Not for a returned loss
        alone (a 0-d tensor, or a dict of ``loss`` only), which evaluation steps return by habit."""
        hook = self.current.hook
        if hook in self._told_dropped or hook == "predict_step":
            return
        returned = sorted({type(r).__name__ for r in self.current.results if not _loss_alone(r)})
        if returned:
            self._told_dropped.add(hook)
            warnings.warn(_dropped(hook, returned), stacklevel=2)

    def mean_loss(self) -> torch.Tensor:
        """The step's loss: the mean over micro-batches, computed as the executor computes it."""
        return torch.stack(self.current.losses).mean()

    @property
    def _name(self) -> str:
        return self.contract.name or "the Sequential"


def _loss_elsewhere(hook: str, where: str) -> str:
    return (
        f"the loss {hook} returned under strategy='twobp' uses {where}, which this rank does not hold: the "
        f"step's code after the pipelined call runs on the last stage only, where the layers of other stages are "
        f"placeholders without weights, so a term of their weights in the loss (a penalty such as "
        f"`c * self.layers[0].weight.abs().sum()`) cannot be computed there. Add the term's gradient instead, in "
        f"on_after_backward on every rank: `for p in self.layers[0].parameters(): p.grad.add_(c * p.sign())` (a "
        f"layer of another stage has no parameters there, so each rank adds the gradient of those it holds); for "
        f"an L2 penalty c * sum(p**2) of every parameter, the optimizer's weight_decay=2*c (without gradient clipping)"
    )


_WHOLE_MODEL = (
    "add a penalty's gradient instead, on every rank for the parameters it holds: for an L2 penalty c * sum(p**2) "
    "the optimizer's weight_decay=2*c (exact for SGD and Adam's coupled decay, without gradient clipping); for an "
    "L1 penalty or any other per-parameter term, in on_after_backward: `for p in self.parameters(): "
    "p.grad.add_(c * p.sign())` (outside the step parameters() is this rank's own, as it should be there). Count "
    "parameters in a hook outside the step (on_fit_start), with trainer.strategy.stage_ids saying which stages a "
    "rank holds; an EMA teacher of the pipelined layers is not supported (no rank holds all their weights)"
)


def _no_whole_model_reads(holders: list[tuple[str, Any]], hook: str) -> list[tuple[Any, str, Any]]:
    """While ``hook`` runs: iterating ``parameters()`` or ``named_parameters()`` to the end, of a module that
    holds placeholders of other ranks' layers (or of a placeholder: ``holders``), raises naming the module. On
    each rank they yield that rank's stages' parameters only, so ``loss + c * sum(p.pow(2).sum() for p in
    self.parameters())`` trained silently differently from one process (found by a trial: 0.0024 off after 3
    steps). Reads that stop early (``next(self.parameters()).device``, a model's ``self.dtype``) still work,
    and outside the step (configure_optimizers, hooks) nothing changes. The shadows of their
    ``named_parameters`` (which ``parameters`` calls; see :func:`shadowed`)."""
    return [(module, "named_parameters", _refusing(module, name, hook)) for name, module in holders]


def placeholder_holders(lm: Any) -> list[tuple[str, Any]]:
    """The modules of ``lm`` that are, or hold, a placeholder of another rank's layer (by name)."""
    modules = dict(lm.named_modules(remove_duplicate=False))
    remote = [name for name, m in modules.items() if is_placeholder(m)]
    names = {".".join(n.split(".")[:k]) for n in remote for k in range(len(n.split(".")) + 1)} if remote else set()
    return [(n, modules[n]) for n in sorted(names) if n in modules]


def _refusing(module: Any, name: str, hook: str) -> Callable[..., Iterator[tuple[str, torch.Tensor]]]:
    own = type(module).named_parameters

    def named_parameters(*args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        yield from own(module, *args, **kwargs)
        if kwargs.get("recurse", args[1] if len(args) > 1 else True):
            label = f"self.{name}" if name else "self"
            raise ElsewhereError(
                f"{hook} iterated {label}.parameters() (or named_parameters()) to the end under strategy='twobp': "
                f"{label} holds layers of other pipeline stages, so on each rank it yields that rank's stages' "
                f"parameters only, and a sum over them (a penalty, a parameter count, an EMA teacher's update) is not "
                f"one process's; {_WHOLE_MODEL}"
            )

    return named_parameters


def _extra_keys(hook: str, keys: list[str]) -> str:
    return (
        f"twobp: {hook} returned {keys} beside 'loss': under strategy='twobp' it runs once per micro-batch on the "
        f"last pipeline stage, and the step's outputs (on_train_batch_end's `outputs`, on every rank) hold only "
        f"'loss'. Log what the step measures with self.log (combined over the micro-batches as one process "
        f"logs it), or collect it in a torchmetrics Metric or in the module's own state (on the last stage)"
    )


def _loss_alone(result: Any) -> bool:
    loss = result.get("loss") if isinstance(result, dict) and set(result) == {"loss"} else result
    return loss is None or (isinstance(loss, torch.Tensor) and loss.dim() == 0)


def _dropped(hook: str, returned: list[str]) -> str:
    batch_end = f"on_{hook.removesuffix('_step')}_batch_end"
    return (
        f"twobp: {hook} returned {', '.join(returned)}: under strategy='twobp' it runs once per micro-batch on the "
        f"last pipeline stage, and what it returns is not carried: {batch_end}'s `outputs` is None on every rank. "
        f"Log what the step measures with self.log (combined over the micro-batches as one process logs it), or "
        f"collect it in a torchmetrics Metric logged with self.log or in the module's own state (on the last stage)"
    )


def step_means(state: StepState) -> Logs:
    """Each logged value over the step's micro-batches as one process logs it for the whole batch, by its
    ``reduce_fx`` (Lightning's epoch reduction, which also says what a step's value is): ``"mean"`` (the
    default) weighted by the micro-batches' sizes (their ``batch_size=`` where every one gives it, taken as
    the count the value is a mean over; else their samples), ``"sum"`` added up, ``"max"``/``"min"`` the
    extreme. A ``batch_size=`` logged with it becomes the step's total. A Metric stays a reference: its
    state holds the whole step."""
    sizes = state.sizes
    means: Logs = {}
    for name in state.logs[0] if state.logs else {}:
        values = [logs[name][0] for logs in state.logs]
        kws = [logs[name][1] for logs in state.logs]
        kw = dict(kws[0])
        if isinstance(values[0], MetricRef):
            means[name] = (values[0], kw)
            continue
        counts: list[Any] = [k.get("batch_size") for k in kws]
        counted = all(c is not None for c in counts)
        kw.pop("batch_size", None)  # the step's own, or none: not the first micro-batch's
        if counted:
            kw["batch_size"] = sum(int(c) for c in counts)  # Lightning takes an int
        weights = [int(c) for c in counts] if counted and kw["batch_size"] > 0 else sizes
        means[name] = (_combine(values, reduction(kw), weights), kw)
    return means


def log_step_values(lm: Any, means: Logs, resolve: Callable[[Any], Any], device: Any, sync: bool) -> None:
    """Log a step's values (:func:`step_means`) on this rank. Every rank of a pipeline holds the same
    values, so a synchronised value (``sync_dist=True``, or ``sync``: evaluation's default) is reduced over
    the data-parallel group only, as one process over all the data would see it: over the whole world a
    ``"sum"`` would count each replica once per pipeline rank."""
    for name, (value, kw) in means.items():
        value = resolve(value)
        value = value.to(device) if isinstance(value, torch.Tensor) else value
        if sync:
            kw = {"sync_dist": True, **kw}
        if kw.get("sync_dist") and kw.get("sync_dist_group") is None:
            kw = {**kw, "sync_dist_group": DP_GROUP}
        lm.log(name, value, **kw)


def reduction(kw: dict) -> str:
    """``self.log``'s ``reduce_fx`` as a name: mean, sum, max or min (Lightning's four; see
    :class:`_LogRecorder` for the others)."""
    fx = kw.get("reduce_fx", "mean")
    if isinstance(fx, str):
        fx = fx.lower()
        return "mean" if fx == "avg" else fx
    return _REDUCTIONS.get(fx, "custom")


_REDUCTIONS: dict[Any, str] = {torch.mean: "mean", torch.sum: "sum", sum: "sum", torch.max: "max", max: "max"}
_REDUCTIONS.update({torch.min: "min", min: "min"})


def _combine(values: list[Any], how: str, weights: list[int]) -> Any:
    """The micro-batches' ``values`` as the whole batch's (:func:`step_means`). Tensors are added in at
    least fp32 (a bf16 count stops at 256, a bool sum is an OR); a micro-batch weighing 0 adds nothing
    (a masked mean over no tokens is NaN there)."""
    if isinstance(values[0], torch.Tensor):
        values = [v.to(torch.promote_types(v.dtype, torch.float32)) for v in values]
    if how == "sum":
        return functools.reduce(operator.add, values)
    if how in ("max", "min"):
        if isinstance(values[0], torch.Tensor):
            return functools.reduce(torch.maximum if how == "max" else torch.minimum, values)
        return (max if how == "max" else min)(values)
    total = sum(weights)
    return functools.reduce(operator.add, [v * (w / total) for v, w in zip(values, weights, strict=True) if w])


def share_logs(
    state: StepState | None,
    loss: torch.Tensor | None,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    states: States | None = None,
    stop: bool | None = None,
) -> tuple[torch.Tensor | None, Logs, States, bool]:
    """The loss, the logged values, the Metrics' step states of one evaluation step and the last stage's
    ``trainer.should_stop`` (``stop``: the step's code may set it, on the last stage only), on every rank
    of the pipeline.

    They live on the rank holding the last stage (``src``, a global rank): there each logged value is
    averaged over the micro-batches (:func:`step_means`), and all are broadcast to the pipeline's ranks
    (one object broadcast; ``state`` is None on other ranks). Training steps use the non-blocking
    :class:`~.logs.LogChannel` instead."""
    payload = None
    if state is not None:
        means = {
            name: (v.cpu() if isinstance(v, torch.Tensor) else v, kw) for name, (v, kw) in step_means(state).items()
        }
        metrics = {p: {k: v.cpu() for k, v in st.items()} for p, st in (states or {}).items()}
        payload = (None if loss is None else loss.detach().cpu(), means, metrics, bool(stop))
    box = [payload]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.broadcast_object_list(box, src=src, group=group, device=device if device.type == "cuda" else None)
    shared = box[0]
    assert shared is not None, "share_logs: no rank held the step's state"
    return shared
