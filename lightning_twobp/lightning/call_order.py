"""Where the modules outside the pipelined blocks run, before the loop over the blocks or after it, as the
model's forward calls them: traced once before the cut, so that the ModuleList contract places each on the
first stage or the last (:meth:`~.modulelist_contract.ModuleListContract.place_by_calls`).

Registration order said it until now, and Hugging Face models do not all register in call order: OPT's
decoder registers ``final_layer_norm`` before ``layers`` and calls it after the loop, BART's encoder
``layernorm_embedding`` after ``layers`` and calls it before, as do DeBERTa-v2's encoder (``rel_embeddings``,
``LayerNorm``) and Wav2Vec2's with ``do_stable_layer_norm``. Each failed at the first step, naming a
re-registration to make by hand.

**The trace.** On the first batch of the data (as ``balance="time"`` reads it), the step's code runs up to
the model call, which is captured as a stage captures it; then a copy of the model (the module the step
calls) on the meta device (no memory, no compute) runs on those arguments, on meta, with each outside
module's calls, the ops that take its weights, and the blocks' calls recorded in order. Hugging Face's
mask checks read values, which meta does not hold: they are answered as an unpadded batch answers them,
and any other value read as zero (False) (:class:`~lightning_twobp.meta_forward.OrdinaryBatch`): the
trace wants the order of the calls, and where a wrong answer changed it, the first step names the
misplaced module. Rank 0 traces and sends the answer, so every rank places alike; the random state is
forked around it all.

**What it decides.** A module called only before the first block goes to the first stage, only after the
last to the last stage. One called on both sides or inside the loop, or not called by the model's forward
(a head the step calls itself), keeps its registration-order place; where the trace cannot run (the
forward fails on meta, no batch is found), every module keeps it, and the reason goes into
the error a misplaced module raises at its first call. The placement changes nothing for a model whose
registration order was its call order: those are the models that trained before.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_twobp.lightning.layer_runs import capture_first
from lightning_twobp.lightning.modulelist_contract import ModuleListContract, caches_off, without_installed_forwards
from lightning_twobp.lightning.outside_modules import LooseParameter
from lightning_twobp.lightning.profile import data_loop, first_batch, streaming
from lightning_twobp.lightning.rng import drawing_from
from lightning_twobp.lightning.step import StepRunner
from lightning_twobp.meta_forward import OrdinaryBatch
from lightning_twobp.own_generators import keep_generators
from lightning_twobp.private import module_copy, pytree

log = logging.getLogger(__name__)

__all__ = [
    "Reads",
    "call_sides",
    "place_by_call_order",
    "place_captured",
    "refuse_reads_elsewhere",
    "sides_on_meta",
    "traced_sides",
]

_BLOCK = object()  # a block's call in the recorded order

# The sides of the loop ("before", "after", "inside") on which the model's forward uses a parameter outside any call
# of the outside modules holding it (a weight read directly), by its holders: (module path, parameter name, shape)
# for each (several where it is tied).
Holders = tuple[tuple[str, str, tuple[int, ...]], ...]
Reads = dict[Holders, set[str]]


def place_by_call_order(runner: StepRunner, contract: ModuleListContract, trainer: Any, precision: Any) -> None:
    """Trace the call order on every rank, check that the ranks agree, and place the outside modules by it (the
    module docstring); the moves are shown."""
    device = trainer.strategy.root_device
    start = time.perf_counter()
    generators = keep_generators(trainer.lightning_module.modules())  # the modules' own (the trace shares them)
    with drawing_from(None, [device] if device.type == "cuda" else []):  # torch's, NumPy's and Python's put back
        batch = _batch(trainer)
        reads: Reads = {}
        sides, why = _traced(runner, contract, trainer, batch, device, precision, reads)
    generators()
    sides, why, reads = _agreed(sides, why, reads)
    moved = contract.place_by_calls(sides, why)
    refuse_reads_elsewhere(contract, reads)  # every rank, before any compute: they agreed on the trace
    log.debug("twobp: call order traced in %.3f s", time.perf_counter() - start)
    if why is not None:
        log.info("twobp: the modules outside %s are placed by registration order: %s", contract.list_name, why)
    for path in moved:  # shown: a module placed against its registration order, which the user may look for
        stage = "first" if sides[path] == "before" else "last"
        how = "used" if isinstance(dict(contract.outside()).get(path), LooseParameter) else "called"
        rank_zero_info(f"twobp: {path} is {how} {sides[path]} {contract.list_name}: placed on the {stage} stage")


def _agreed(sides: dict[str, str], why: str | None, reads: Reads) -> tuple[dict[str, str], str | None, Reads]:
    """Every rank's trace, the same everywhere: each rank traced its own first batch (every rank runs the step's
    code alike), and where they differ none is used."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return sides, why, reads
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, (sides, why, reads))
    if all(f == found[0] for f in found):
        return found[0]
    differ = next(r for r, f in enumerate(found) if f != found[0])
    why = f"the ranks traced different call orders (rank 0: {found[0][0]}; rank {differ}: {found[differ][0]})"
    return {}, why, {}


def _batch(trainer: Any) -> Any:
    """The first batch, or why there is none to trace on (every rank reads it: the data setup synchronises
    them). A stream (an ``IterableDataset``) is not read: the loop's setup reads a batch ahead, and a stream's
    would be gone for training; so the loader is looked at before it is set up."""
    if streaming(data_loop(trainer)) is not None:
        return _NoBatch("the data is an IterableDataset, not read before training (its first batch would be lost)")
    try:
        return first_batch(trainer, _first)
    except ValueError as e:  # no dataloader: the trace cannot run
        return _NoBatch(f"no dataloader was found: {_first_line(e)}")


def _first(loader: Any) -> Any:
    try:
        return next(iter(loader))
    except StopIteration:
        return _NoBatch("the data holds no batch")


class _NoBatch:
    def __init__(self, why: str) -> None:
        self.why = why


def _traced(
    runner: StepRunner,
    contract: ModuleListContract,
    trainer: Any,
    batch: Any,
    device: torch.device,
    precision: Any,
    reads: Reads,
) -> tuple[dict[str, str], str | None]:
    """:func:`traced_sides` of the step's call of the model on ``batch``, or no sides and why."""
    if isinstance(batch, _NoBatch):
        return {}, f"no batch to trace it on: {batch.why}"
    try:
        _capture(runner, trainer, batch, device, precision)
    except Exception as e:  # noqa: BLE001 - the step's own error: the first step raises it again
        return {}, f"the step did not reach the model's call ({type(e).__name__}: {_first_line(e)})"
    return traced_sides(contract, training=trainer.state.fn == TrainerFn.FITTING, reads=reads)


def _capture(runner: StepRunner, trainer: Any, batch: Any, device: torch.device, precision: Any) -> None:
    """The step's call of the model on the first micro-batch, captured as a stage captures it."""
    runner.metrics.begin()  # the step's Metrics updates before the call, put back
    try:
        capture_first(runner, trainer, batch, device, precision, 1)
    finally:
        runner.metrics.undo()


def place_captured(contract: ModuleListContract) -> list[str]:
    """Place the outside modules by the call order of the model call the contract has captured (``twobp-plan``'s
    single process, whose call is on meta already); returns the modules moved."""
    return contract.place_by_calls(*traced_sides(contract, training=False))


def traced_sides(
    contract: ModuleListContract, training: bool, reads: Reads | None = None
) -> tuple[dict[str, str], str | None]:
    """``(sides, why)``: each outside module's side of the loop in the model call the contract captured
    (:func:`call_sides`), run in training mode or not, and None; or no sides and why none were traced."""
    call = contract.captured_call(0)
    path = next(p for p, m in contract.ancestors if m is call.owner)
    return sides_on_meta(contract, call.owner, path, call.tensors, call.rebuild, training, reads)


def sides_on_meta(
    contract: ModuleListContract,
    owner: nn.Module,
    path: str,
    tensors: list[torch.Tensor],
    rebuild: Callable[[list[torch.Tensor]], tuple[tuple, dict]],
    training: bool,
    reads: Reads | None = None,
) -> tuple[dict[str, str], str | None]:
    """:func:`traced_sides` of ``owner`` (at ``path``) called on ``rebuild(tensors)``, each tensor on meta."""
    try:
        twin = _meta_copy(owner).train(training)
    except Exception as e:  # noqa: BLE001 - any failure leaves registration order, and says why
        return {}, f"the model could not be copied to the meta device ({type(e).__name__}: {_first_line(e)})"
    why: str | None = None
    partial: dict[str, str] = {}
    # Some meta kernels take bf16 only, as their GPU kernels do (torch's grouped matmul of a mixture of experts:
    # Jamba's, Qwen3-Next's): the call order does not depend on the dtype, so an fp32 model is traced again in bf16
    for dtype in (None, torch.bfloat16):
        args, kwargs = rebuild([_on_meta(t, dtype) for t in tensors])
        try:
            if reads is not None:
                reads.clear()  # a failed first try's
            return call_sides(twin if dtype is None else twin.to(dtype), path, contract, args, kwargs, reads), None
        except _NoBlocks as e:
            return {}, str(e)
        except Exception as e:  # noqa: BLE001 - the first failure is the one to tell
            why = why or f"the model's forward did not run on the meta device ({type(e).__name__}: {_first_line(e)})"
            partial = partial or getattr(e, "twobp_loose_before", {})
    return partial, why


def _on_meta(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return torch.empty_like(t, device="meta", dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)


def call_sides(
    twin: nn.Module, path: str, contract: ModuleListContract, args: tuple, kwargs: dict, reads: Reads | None = None
) -> dict[str, str]:
    """Each outside module of ``contract`` inside the model at ``path`` that ``twin(*args, **kwargs)`` calls or
    whose weights it uses (``twin``: the model's meta copy): ``"before"`` the first block, ``"after"`` the last,
    ``"both"``, or ``"inside"`` (between the first block's call and the last's). ``reads``, where given, gets the
    sides on which a parameter is used outside any call of a module holding it (:data:`Reads`)."""
    within = path + "." if path else ""  # "": the LightningModule's own forward, called by the step as self(x)
    inside = {p: part for p, part in contract.outside() if p.startswith(within)}
    order: list[Any] = []
    uses = _ParameterUses(order)
    with ExitStack() as scope:
        for p, part in inside.items():
            if isinstance(part, LooseParameter):  # its holder's copy's parameter of that name, not a module
                holder, _, n = p[len(within) :].rpartition(".")
                uses.loose(p, twin.get_submodule(holder)._parameters[n], part.tensor())
            else:
                scope.enter_context(uses.owned_by(p, twin.get_submodule(p[len(within) :]), part))
        for block in twin.get_submodule(contract.list_name[len(within) :]).children():
            scope.callback(block.register_forward_pre_hook(_recorder(order, _BLOCK)).remove)
            scope.callback(block.register_forward_hook(_recorder(order, _BLOCK)).remove)
        scope.callback(caches_off(twin.modules()))  # as the Trainer call runs it
        scope.enter_context(torch.no_grad())
        scope.enter_context(OrdinaryBatch(type(twin).__name__, {}, strict=False, zero_otherwise=True))
        scope.enter_context(uses)
        try:
            twin(*args, **kwargs)
        except Exception as e:
            # Hugging Face's CTC loss after the blocks has no meta kernel: the modules keep their registration
            # places, but a parameter held directly, used before the first block, was seen there all the same
            loose = {p for p, part in inside.items() if isinstance(part, LooseParameter)}
            e.twobp_loose_before = _before_blocks(order, loose)  # type: ignore[attr-defined]
            raise
    sides = _sides(order)
    if reads is not None:
        reads.update(_read_sides(order, uses.reads))
    return sides


class _ParameterUses(TorchFunctionMode):
    """Each call of an outside module, and each op that takes one of their parameters and makes a tensor (DeBERTa-v2's
    encoder reads ``rel_embeddings.weight`` before its loop; a read of ``.dtype`` or ``.shape`` makes none) outside
    a call of that parameter's module, records the module's path in ``order``: a parameter tied between several
    modules, each of them."""

    def __init__(self, order: list[Any]) -> None:
        super().__init__()
        self._order = order
        self._owners: dict[int, list[str]] = {}
        self._running: list[str] = []  # the outside modules whose forwards are running: their weights' uses are theirs
        self._stand_in: dict[int, nn.Parameter] = {}  # id of an original parameter -> its meta copy in the twin
        self._holders: dict[int, Holders] = {}
        self.reads: list[tuple[int, Holders]] = []  # (place in the order, holders): uses outside their calls

    def loose(self, path: str, param: Any, original: torch.Tensor) -> None:
        """Record the uses of ``param`` (the meta copy of ``original``), held directly by a module on the path to the
        blocks, as ``path``'s: each a read outside any call (:data:`Reads`), on the side of the loop it is placed on."""
        self._owners.setdefault(id(param), []).append(path)
        self._holders[id(param)] = ((path, path, tuple(param.shape)),)
        self._stand_in[id(original)] = param

    @contextmanager
    def owned_by(self, path: str, module: nn.Module, original: nn.Module) -> Iterator[None]:
        """Record ``module``'s calls and its parameters' uses as ``path``'s, while open; ``original`` is the module
        ``module`` is the meta copy of, whose parameters a reference kept outside the module tree still reaches
        (torchtune's TiedLinear keeps ``tied_module``, the embedding: the copy shares it)."""
        for (n, q), o in zip(module.named_parameters(), original.parameters(), strict=True):
            self._owners.setdefault(id(q), []).append(path)
            self._holders[id(q)] = (*self._holders.get(id(q), ()), (path, f"{path}.{n}", tuple(q.shape)))
            self._stand_in[id(o)] = q
        handles = []  # a submodule called on its own is the module's too (self.embeddings.word_embeddings(ids))
        for m in module.modules():
            handles += [m.register_forward_pre_hook(self._entered(path)), m.register_forward_hook(self._left)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _entered(self, path: str) -> Callable[..., None]:
        def enter(*_: Any) -> None:
            if path not in self._running:
                self._order.append(path)
            self._running.append(path)

        return enter

    def _left(self, *_: Any) -> None:
        self._running.pop()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # an original parameter, reached through a reference the copy shares, is traced as its meta copy: recorded
        # as its module's use, and no op runs on real data
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: self._stand_in.get(id(t), t), (args, kwargs or {}))
        out = func(*args, **kwargs)
        if not any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(out)):
            return out
        for x in pytree.tree_leaves((args, kwargs or {})):
            owners = self._owners.get(id(x), ()) if isinstance(x, nn.Parameter) else ()
            # a use inside a call of one of its owners is that call's (a head tied to the embedding: the head's);
            # inside another module's, it is its own (DeBERTa-v2's LayerNorm of rel_embeddings.weight)
            if owners and not any(p in self._running for p in owners):
                self._order.extend(owners)
                self.reads.append((len(self._order) - 1, self._holders[id(x)]))
        return out


def _read_sides(order: list[Any], reads: list[tuple[int, Holders]]) -> Reads:
    """Each read's side of the loop in the recorded ``order`` (``reads``: its place there and the holders)."""
    blocks = [k for k, x in enumerate(order) if x is _BLOCK]
    found: Reads = {}
    for k, holders in reads:
        found.setdefault(holders, set()).add("before" if k < blocks[0] else "after" if k > blocks[-1] else "inside")
    return found


def refuse_reads_elsewhere(contract: ModuleListContract, reads: Reads) -> None:
    """Refuse a parameter the model's forward uses directly, outside any call of its module, on the side of the loop
    whose stage does not hold that module: the stage would compute with the set-aside meta weight (another rank's)
    or with another stage's (a V schedule's first and last on one rank), and B or W gives it no gradient. The first
    F refused it (:meth:`~lightning_twobp.engine.stage.Stage._refuse_foreign`), after the earlier stages had run;
    here every rank refuses it at setup, before any compute."""
    for holders, on in reads.items():
        for side in sorted(on & {"before", "after"}):
            if not any(contract.on_first_stage(path) == (side == "before") for path, _, _ in holders):
                raise ValueError(_read_elsewhere(contract, holders, side))


def _read_elsewhere(contract: ModuleListContract, holders: Holders, side: str) -> str:
    path, name, shape = holders[0]
    weights = f"{name} (shape {shape})"
    held, other = ("last", "first") if side == "before" else ("first", "last")
    return (
        f"the model's forward uses {weights} {side} {contract.list_name}, outside any call of {path} (traced on the "
        f"meta device before the cut): {path} is on the {held} pipeline stage, and the {other} stage, which runs the "
        f"code {side} the blocks, does not hold its weights, so that use would compute without them and give them "
        f"no gradient. This is a head tied by a reference kept outside the module tree (torchtune's TiedLinear keeps "
        f"`tied_module`, the embedding) or by a direct read (`h @ embed.weight.T`). Tie the head as a module of its "
        f"own, called {side} the loop: `head = nn.Linear(dim, vocab, bias=False); head.weight = embed.weight` in "
        f"place of the reference (torchtune: `model.output = head` with `model.tok_embeddings.weight`); tied modules "
        f"on two stages are kept in sync (docs/strategy.md, 'Tied embeddings')"
    )


def _before_blocks(order: list[Any], paths: set[str]) -> dict[str, str]:
    """Of ``paths``, those a partial ``order`` (the trace stopped by a failure) records used before the first block
    only: ``"before"`` each. Nothing is said of the others (their later uses were not seen)."""
    if _BLOCK not in order:
        return {}
    first = order.index(_BLOCK)
    seen = {x for x in order[:first] if x in paths}
    return {p: "before" for p in seen if p not in order[first:]}


def _recorder(order: list[Any], what: Any) -> Callable[..., None]:
    def record(*_: Any) -> None:
        order.append(what)

    return record


class _NoBlocks(Exception):
    """The traced forward called none of the blocks."""


def _sides(order: list[Any]) -> dict[str, str]:
    """Each module's side of the loop in the recorded ``order`` (the blocks' calls are ``_BLOCK``)."""
    blocks = [k for k, x in enumerate(order) if x is _BLOCK]
    if not blocks:
        raise _NoBlocks("the model's forward, traced on the meta device, called none of the blocks")
    first, last = blocks[0], blocks[-1]
    seen: dict[str, set[str]] = {}
    for k, x in enumerate(order):
        if x is not _BLOCK:
            seen.setdefault(x, set()).add("before" if k < first else "after" if k > last else "inside")
    return {x: "inside" if "inside" in on else "both" if len(on) > 1 else on.pop() for x, on in seen.items()}


def _meta_copy(module: nn.Module) -> nn.Module:
    """``module`` with every parameter and buffer on the meta device (no data; its other attributes shared, a
    LightningModule's trainer among them), without forward hooks (the user's would run on the trace's meta values)
    nor the instance forwards the ModuleList contract installs (they call the original modules)."""
    memo: dict[int, Any] = {}
    for t in [*module.parameters(), *module.buffers()]:
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return without_installed_forwards(module_copy(module, memo))


def _first_line(e: BaseException) -> str:
    """The error's first line, up to a sentence's end within 300 characters (torch's meta-kernel errors run on
    for a paragraph: cut mid-word, the reason read "please set 'torch.fx.experimental._con")."""
    line = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if len(line) <= 300:
        return line
    ends = [m.end() for m in re.finditer(r"(?<!e\.g)(?<!i\.e)\.(?= [A-Z])", line[:300])]  # not at "e.g. X"
    return line[: ends[-1]] if ends else line[:300] + "..."
