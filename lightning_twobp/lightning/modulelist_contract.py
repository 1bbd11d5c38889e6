"""The ModuleList contract: blocks in an ``nn.ModuleList`` that the model's own ``forward`` calls in a loop.

Hugging Face decoders and encoders, torchtitan's and nanoGPT's models all look like this::

    h = self.wte(ids) + self.wpe(pos)                          # before the loop: the first stage
    mask, rope = make_mask(attention_mask, h), self.rotary(h)   # side inputs, from the batch
    for block in self.h:                                        # the pipelined blocks
        h = block(h, attention_mask=mask, position_embeddings=rope, use_cache=False)
    return self.lm_head(self.ln_f(h))                           # after the loop: the last stage

**Every stage runs the model's unchanged forward on its micro-batch** (torchtitan's choice: keep the
model's forward and drop what a stage does not hold; torch's ``pipeline()`` tracer instead cuts a
traced graph, which an HF forward with its data-dependent mask code and cache objects does not
survive, and which sends every value a later stage uses). While a stage runs:

* a block before the stage's first is skipped: it returns, at once, an
  :class:`~lightning_twobp.lightning.placeholders.Elsewhere` value of its output's shape;
* the stage's first block gets the hidden state the previous stage sent instead of its argument;
* the stage's blocks run; at the next stage's first block the stage stops and sends that block's
  hidden state (a tensor) on;
* modules with parameters outside the blocks belong to the first layer (those the forward calls before
  the loop: embeddings) or to the last (those it calls after it: final norm, LM head), as a trace before
  the cut finds (:mod:`.call_order`; registration order where it cannot say). On other stages they, too,
  yield ``Elsewhere`` values, computed on the meta device.

So **side inputs are recomputed on every stage from its own micro-batch**, by the model's own code:
masks, position ids, rotary embeddings, cache positions, non-tensor flags; none of them travels. A
value that does depend on something a stage does not hold reaches it as ``Elsewhere`` and raises
there (see :mod:`.placeholders`): a side input computed from the embeddings, a block that returns several
hidden states (a residual stream), data-dependent control flow between blocks, per-block hidden
states collected for the output. Blocks called out of order, skipped or repeated raise too.

What a stage needs to re-run the model is the micro-batch's call of it, i.e. the arguments the step
passed to the model. The first stage captures them (as the Sequential contract captures its input)
and gets them from the executor. Every other stage re-runs the step's code up to the model call on
its own rank's copy of the batch. The executor does not say which micro-batch a stage is running,
so a 0-d int64 micro-batch index travels beside the hidden state, and a stage picks its micro-batch's
arguments with it on the device (``index_select``; no host sync in training). The last stage needs
no index: it runs the model inside the step itself, where the executor hands the loss function the
micro-batch index.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeGuard, TypeVar

import torch
from torch import nn

from lightning_twobp.lightning.checks import LOOP_AUX, grad_scalars, stored_for_loss
from lightning_twobp.lightning.in_place import starts_in_place
from lightning_twobp.lightning.outside_modules import LooseParameter, OutsideModules, registered_sides
from lightning_twobp.lightning.placeholders import (
    Elsewhere,
    ElsewhereError,
    ElsewhereWrite,
    StandIn,
    elsewhere,
    find_elsewhere,
)
from lightning_twobp.private import forward_hooks, pytree, tensor_version

_T = TypeVar("_T")
log = logging.getLogger(__name__)

__all__ = [
    "LayerGroup",
    "LoopStage",
    "ModuleListContract",
    "caches_off",
    "fastpath_off",
    "identical_blocks",
    "without_installed_forwards",
]

_MISSING = object()
_CALLS = object()  # in an install list: the placeholder's ``_calls`` (see ``_running``), removed on uninstall


class _Stop(BaseException):
    """Raised at the next stage's first block to end a stage's run (a BaseException, so that no
    ``except Exception`` in model code swallows it)."""

    def __init__(self, carried: tuple[torch.Tensor, ...], positions: list[int]) -> None:
        super().__init__("stage done")
        self.carried, self.positions = carried, positions


def fastpath_off() -> Callable[[], None]:
    """torch's multi-head-attention fast path off for the Trainer call; returns the undo. In evaluation
    ``nn.TransformerEncoder`` takes it when it sees its first layer's real weights, and with a padding
    mask it turns the hidden state into a nested tensor: only the stage holding that layer would, and a
    nested tensor cannot travel to the next stage (torch: "NestedTensorImpl doesn't support sizes"). The
    plain path computes the same values (up to rounding; padded positions hold values, not zeros)."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    return lambda: torch.backends.mha.set_fastpath_enabled(before)


def caches_off(modules: Iterable[nn.Module], why: str | None = None) -> Callable[[], None]:
    """Hugging Face's ``config.use_cache`` off, for the Trainer call, in the configs ``modules`` hold;
    returns the undo; logs ``why`` where one was on. Under this contract (``model.modules()``): a model
    that keeps a key/value cache builds it from every block's keys and values, per block, the values of
    blocks on other stages, which this contract cannot return (transformers 4.x's GPT-2 returns them as
    ``presents`` by default, in training too, and the call was refused). No loss reads a cache, so
    training and evaluation compute the same without it; a call that passes ``use_cache=True`` itself is
    still refused, naming it. Checkpointing turns it off too (lightning/checkpointing.py)."""
    configs: dict[int, Any] = {id(m.config): m.config for m in modules if hasattr(m, "config")}
    on = [c for c in configs.values() if getattr(c, "use_cache", None) is True]
    for c in on:
        c.use_cache = False
    if on and why is not None:
        log.info("twobp: config.use_cache is off for this Trainer call (%s)", why)

    def undo() -> None:
        for c in on:
            c.use_cache = True

    return undo


def _made_from(tensors: Sequence[torch.Tensor], root: nn.Module, most: int = 10_000) -> str:
    """For a refusal: the parameters of ``root`` that ``tensors`` were computed from in the step (their graphs'
    leaves, up to ``most`` nodes), as " (computed from model.embed_tokens.weight)"; "" where none is found."""
    # the class's own walk: during the step a holder's named_parameters refuses to be read to the end (step.py)
    names = {id(q): n for n, q in nn.Module.named_parameters(root)}
    seen: set[Any] = set()
    stack: list[Any] = [t.grad_fn for t in tensors]
    found: list[str] = []
    while stack and len(seen) < most:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # an AccumulateGrad node's parameter
        if leaf is not None and id(leaf) in names:
            found.append(names[id(leaf)])
        stack.extend(n for n, _ in node.next_functions)
    found += [names[id(t)] for t in tensors if t.grad_fn is None and id(t) in names]  # a parameter itself
    return f" (computed from {', '.join(sorted(set(found))[:3])})" if found else ""


def identical_blocks(ml: nn.ModuleList) -> bool:
    """Whether ``ml`` holds blocks of one class that have parameters: what automatic discovery pipelines
    (a ModuleList of metrics or of parameter-free modules is not a stack of layers, nor is the
    ``ParametrizationList`` torch's ``parametrize`` puts in a weight-normed layer: Wav2Vec2's positional conv)."""
    if isinstance(ml, torch.nn.utils.parametrize.ParametrizationList):
        return False
    return len(ml) > 0 and len({type(m) for m in ml}) == 1 and next(ml.parameters(), None) is not None


class LayerGroup(nn.Module):
    """Layer ``i`` as the partition sees it: block ``i``, with the modules that run before the loop
    (layer 0) or after it (the last layer). Holds the user's modules, not copies; not callable."""

    def __init__(self, parts: list[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self.paths = [p for p, _ in parts]  # each part's dotted path in the LightningModule
        for k, (_, module) in enumerate(parts):
            self.add_module(str(k), module)

    def parts(self) -> list[nn.Module]:
        return [_child(self, str(k)) for k in range(len(self.paths))]

    def path_of(self, name: str) -> str:
        """The LightningModule's name for ``name`` (``"k.rest"`` inside this group): a loose parameter's part
        (``"k.cls_token"``) is named by its path (``model.cls_token``)."""
        k, _, rest = name.partition(".")
        if rest and not isinstance(_child(self, k), LooseParameter):
            return f"{self.paths[int(k)]}.{rest}"
        return self.paths[int(k)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a LayerGroup is a unit of the partition, not a module to call")


class LoopStage(nn.Module):
    """One pipeline stage of the ModuleList contract: layers ``first .. stop - 1``.

    Its inputs are ``(micro-batch index, *model-call tensors)`` on the first stage and ``(*carried,
    index)`` on the others; it returns ``(*carried, index)``, or the carried values alone when the next
    stage is the last. ``carried`` is the hidden state, then any other values the next stage's first
    block takes that were made on earlier stages (see :meth:`ModuleListContract.carried`). The last
    stage returns its inputs: it runs inside the step (see the module docstring), through
    :meth:`ModuleListContract.intercept`.
    """

    def __init__(self, contract: ModuleListContract, first: int, stop: int, last_first: int, index: int = 0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(contract.layers()[first:stop])  # the user's modules, shared
        self.first, self.stop, self.last_first, self.index = first, stop, last_first, index
        self._contract = [contract]  # a list: not a submodule
        # looked at once, at the first training forward (checks.stored_for_loss): not on the last stage (which
        # returns first), which the step's code runs, where it reads the blocks' attributes as one process does
        self._look_for_stored = True
        self._at: dict[tuple, torch.Tensor] = {}  # sent positions, by list and device (LoopStage.at)
        self._received_at: dict[tuple, list[int]] = {}  # received positions, by kind of run (LoopStage.unpacked)

    def forward(self, *inputs: Any) -> Any:
        contract = self._contract[0]
        if self.stop == contract.num_blocks:
            return inputs[0] if len(inputs) == 1 else inputs
        look = self._look_for_stored and self.training and torch.is_grad_enabled()
        before = grad_scalars(self.layers) if look else set()
        out = contract.run_stage(self, inputs)
        if look:
            self._look_for_stored = False
            stored_for_loss(self.layers, self._name_of, before, LOOP_AUX, out=out)
        return out

    def at(self, positions: list[int], like: torch.Tensor) -> torch.Tensor:
        """``positions`` as the int64 tensor sent after the carried values (made once per list, on the device)."""
        key = (tuple(positions), like.device)
        if key not in self._at:
            self._at[key] = torch.tensor(positions, dtype=torch.long, device=like.device)
        return self._at[key]

    def unpacked(self, received: tuple[torch.Tensor, ...], call: Any) -> tuple[tuple[torch.Tensor, ...], list[int]]:
        """The values the previous stage sent and where in its first block's call they go: the hidden state
        alone, or the values then their positions, read on the host once per structure of the call (``call``,
        its pytree spec) and kind of run, which are the same for every micro-batch of a step."""
        if len(received) == 1:
            return received, [0]
        key = (len(received), call, torch.is_grad_enabled(), self.training)
        if key not in self._received_at:
            self._received_at[key] = received[-1].tolist()
        return received[:-1], self._received_at[key]

    @property
    def next_block(self) -> str:
        """The next stage's first block, by the model's name for it."""
        return f"{self._contract[0].list_name}[{self.stop}]"

    def _name_of(self, k: int, sub: str) -> str:
        """The model's name of submodule ``sub`` of this stage's layer ``k``: a LayerGroup's "j.rest" is its
        part j's path (a block, the embedding) and ``rest`` in it."""
        group = self.layers[k]
        assert isinstance(group, LayerGroup)
        return group.path_of(sub) if sub else ", ".join(group.paths)


@dataclass
class _Call:
    """One micro-batch's call of the model: which module, and its arguments, flattened."""

    owner: nn.Module
    spec: Any  # pytree spec of (args, kwargs)
    leaves: list[Any]  # the non-tensor leaves; tensor positions hold None
    positions: list[int]  # where the tensors go among the leaves
    tensors: list[torch.Tensor]

    def rebuild(self, tensors: list[torch.Tensor] | tuple) -> tuple[tuple, dict]:
        leaves = list(self.leaves)
        for pos, t in zip(self.positions, tensors, strict=False):
            leaves[pos] = t
        return pytree.tree_unflatten(leaves, self.spec)


@dataclass
class _Calls:
    """The model calls of one step's micro-batches, in order (one per micro-batch)."""

    state: Any  # the StepState they belong to
    calls: list[_Call] = field(default_factory=list)
    checked: bool = False
    stacked: list[torch.Tensor | None] | None = None

    def check(self, name: str) -> None:
        if self.checked:
            return
        first = self.calls[0]
        for k, c in enumerate(self.calls[1:], 1):
            if c.owner is not first.owner or c.spec != first.spec or c.positions != first.positions:
                raise ValueError(
                    f"the step calls {name} differently in micro-batch {k} than in micro-batch 0 (another module, "
                    f"other keyword arguments, or a tensor where there was none): under strategy='twobp' every "
                    f"stage re-runs the same call on its micro-batch, so the call's structure must not depend on "
                    f"the data"
                )
            for pos, (a, b) in enumerate(zip(first.leaves, c.leaves, strict=False)):
                if pos not in first.positions and not _same(a, b):
                    raise ValueError(
                        f"the step calls {name} with {a!r} in micro-batch 0 and {b!r} in micro-batch {k} (argument "
                        f"{pos} of the call, flattened): non-tensor arguments must be the same in every micro-batch"
                    )
        self.checked = True

    def select(self, index: torch.Tensor) -> tuple[nn.Module, tuple, dict]:
        """The owner and arguments of micro-batch ``index`` (a 0-d tensor): in training picked on
        the device from the stacked calls; in evaluation (micro-batches may differ in size, and
        forward-only passes synchronise anyway) read on the host."""
        first = self.calls[0]
        if torch.is_grad_enabled():
            if self.stacked is None:
                self.stacked = [
                    torch.stack(ts) if all(t.shape == ts[0].shape and t.dtype == ts[0].dtype for t in ts) else None
                    for ts in zip(*(c.tensors for c in self.calls), strict=False)
                ]
            stacked = self.stacked
            if _all_set(stacked):
                at = index.reshape(1).to(stacked[0].device) if stacked else index
                tensors = [torch.index_select(s, 0, at)[0] for s in stacked]
                return (first.owner, *first.rebuild(tensors))
        call = self.calls[int(index)]
        return (call.owner, *call.rebuild(call.tensors))


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # objects without a usable ==
        return False


@dataclass
class _Run:
    """One stage's pass through the model's forward."""

    stage: LoopStage
    inject: tuple[torch.Tensor, ...] | None  # the received values, the hidden state first (None on the first stage)
    device: torch.device
    next: int = 0  # the block the loop must call next
    # id of a value the stage's first block was given where a received one goes (an Elsewhere, or the stage's own
    # stand-in) -> (it, the received value): the same object handed to the stage's later blocks (an encoder's
    # output, to every decoder block) is swapped too
    received: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=dict)  # ... its version
    # id -> tensor, for the tensors made on this stage that the next stage does not have: what its blocks return,
    # what it received, and on the first stage what the modules before the blocks return (an encoder's output)
    # (weakly: a value the model lets go of is not kept alive by this, and its id leaves with it)
    made: MutableMapping[int, torch.Tensor] = field(default_factory=weakref.WeakValueDictionary)

    def swapped(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args`` and ``kwargs`` with every received Elsewhere replaced by its value."""
        return self.swapped_in((args, kwargs), is_leaf=_containers_but(kwargs))

    def swapped_in(self, tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
        """``tree`` with every received Elsewhere replaced by its value (the model's output on the last stage: a
        Hugging Face encoder-decoder returns the encoder's output, which the last stage received)."""
        if not self.received:
            return tree
        flat, spec = pytree.tree_flatten(tree, is_leaf=is_leaf)
        if not any(id(x) in self.received for x in flat):
            return tree
        for x in flat:
            if id(x) in self.received and tensor_version(x) != self.received[id(x)][2]:
                raise ElsewhereWrite(
                    f"a value this pipeline stage received from the previous one was changed in place between blocks "
                    f"(its own copy of it, of shape {tuple(x.shape)}): under strategy='twobp' the stage's blocks get "
                    f"the received value, which the change did not reach; make the change out of place inside a "
                    f"block or module (`x = x + 1`, returned by it)"
                )
        return pytree.tree_unflatten([self.received[id(x)][1] if id(x) in self.received else x for x in flat], spec)

    def keep(self, out: Any) -> None:
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made[id(t)] = t

    @property
    def first(self) -> int:  # the stage's first block
        return self.stage.first

    @property
    def stop(self) -> int:  # the next stage's first block (num_blocks on the last stage)
        return self.stage.stop


class ModuleListContract(OutsideModules):
    """The pipelined part is the ``nn.ModuleList`` at ``name`` in ``root`` (see the module docstring).

    ``layers()`` has one :class:`LayerGroup` per block; the first also holds the modules with
    parameters registered before the ModuleList, the last those registered after it, until
    :meth:`place_by_calls` moves them to the side the forward calls them on. The model is the
    outermost module on the path to the ModuleList that the step calls (``model`` for
    ``model.transformer.h``, or the LightningModule's own forward).
    """

    def __init__(self, root: nn.Module, name: str, blocks: nn.ModuleList | nn.Sequential) -> None:
        self.root = root
        self.list_name = name
        self.blocks = blocks
        self.num_blocks = len(blocks)
        if not self.num_blocks:
            raise ValueError(f"{name} is an empty nn.ModuleList: there is nothing to pipeline")
        if len({id(b) for b in blocks}) != self.num_blocks:
            raise ValueError(
                f"{name} holds the same module more than once (blocks that share their weights): under "
                f"strategy='twobp' each block is one layer on one stage; give every entry its own module"
            )
        self.ancestors = _ancestors(root, name)  # (path, module), the LightningModule first
        # The module the step calls: the outermost one below the LightningModule, or its own forward.
        self.name = self.ancestors[1][0] if len(self.ancestors) > 1 else "forward"
        pre, post = registered_sides(root, blocks, name, {id(m) for _, m in self.ancestors})
        OutsideModules.__init__(self, [*pre, *post], {path for path, _ in pre})
        self._groups = self._grouped()
        self._loose = [m for _, m in self._outside if isinstance(m, LooseParameter)]
        modules = [(p, m) for p, m in self._outside if not isinstance(m, LooseParameter)]  # loose: no slot of theirs
        self._slots = {path: _slot(root, path) for path, _ in [*modules, *self._block_parts()]}
        self._runner: Any = None
        self._calls: _Calls | None = None
        self._active: _Run | None = None
        self._stage_of: list[int] = [0] * self.num_blocks  # the partition (stage_module): each block's stage
        self._stages: dict[int, LoopStage] = {}  # this rank's stages, by index, as stage_module built them
        self._twins: dict[tuple[int, torch.dtype | None, str | None, bool], nn.Module] = {}
        self._shapes: dict[tuple, tuple[Any, list[Any]]] = {}  # block call -> its output's structure
        self._twin_ran: set[tuple] = set()  # the block calls whose twin ran (and so ran its hooks)
        self._cast: torch.dtype | None = None  # the twins' dtype while profiling (one_stage_per_layer)
        self._profiling = False  # the stages are one_stage_per_layer's: one per layer, for the profile
        self._block_calls = [self._block_call(i) for i in range(self.num_blocks)]
        self._previous: list[Any] = [_MISSING] * self.num_blocks  # the blocks' own instance forwards, if any
        self._guessed: dict[int, str] = {}  # blocks whose stand-in failed on meta (output guessed): why
        self._absent_out: dict[tuple, tuple[Any, list[Any]]] = {}  # a stand-in's call -> its output's structure

    def _block_parts(self) -> list[tuple[str, nn.Module]]:
        return [(f"{self.list_name}.{i}", b) for i, b in enumerate(self.blocks)]

    def _regroup(self) -> None:
        self._groups = self._grouped()

    def _grouped(self) -> list[LayerGroup]:
        parts = [[part] for part in self._block_parts()]
        parts[0][:0] = [(path, m) for path, m in self._outside if path in self._before]
        parts[-1].extend((path, m) for path, m in self._outside if path not in self._before)
        return [LayerGroup(p) for p in parts]

    # ------------------------------------------------------------------ the Contract interface
    def layers(self) -> list[nn.Module]:
        return list(self._groups)

    def stage_module(self, first: int, stop: int, bounds: Sequence[int]) -> LoopStage:
        self._stage_of = [k for k in range(len(bounds) - 1) for _ in range(bounds[k], bounds[k + 1])]
        stage = LoopStage(self, first, stop, bounds[-2], self._stage_of[first])
        self._stages[stage.index] = stage
        self._check_not_collecting(self.name, {})  # a config's flags: on every rank, before any compute
        return stage

    @contextmanager
    def one_stage_per_layer(self, cast: torch.dtype | None = None) -> Iterator[list[LoopStage]]:
        """Every layer as a stage of its own, to run the layers one at a time before the cut
        (:mod:`.layer_runs`: ``balance="time"``, ``schedule="auto"``). Stage ``k`` runs as the executor
        runs it: ``(index, *call tensors)`` in on the first, ``(hidden, index)`` on the others; the last
        answers the model's call inside the step. ``cast``: the dtype the precision will cast the model
        to, which the other layers' meta twins take (the layers are still as built). What the runs learn
        (stages, twins, block output shapes) is dropped after: learned before the cast, an fp32 shape
        made the stages' rotary embeddings fp32 against bf16 values under "bf16-true"."""
        before = self._stage_of, self._stages, self._twins, self._shapes, self._twin_ran, self._cast, self._profiling
        absent_out = self._absent_out
        self._stages, self._twins, self._shapes, self._twin_ran, self._cast = {}, {}, {}, set(), cast
        self._profiling, self._absent_out = True, {}
        bounds = list(range(self.num_blocks + 1))
        try:
            yield [self.stage_module(i, i + 1, bounds) for i in range(self.num_blocks)]
        finally:
            self._stage_of, self._stages, self._twins, self._shapes, self._twin_ran, self._cast, self._profiling = (
                before
            )
            self._absent_out = absent_out

    def check_every_block_runs(self) -> None:
        """Refuse LayerDrop before fit's first step: in training it skips blocks at random (Wav2Vec2, HuBERT
        and WavLM default to ``layerdrop=0.1``; BART's and Whisper's encoders hold ``layerdrop`` from the
        config), and every stage runs the model's loop with its own draws, so the stages disagree on which
        blocks run. That raised at a random step, possibly late in training, as a block called out of order
        or as a module "registered" in the wrong place (the loop skipped every block before it)."""
        found = _layerdrop(self.ancestors)
        if not found:
            return
        names = " and ".join(f"self.{f.split('=')[0]}" for f in found)
        raise ValueError(
            f"{self.name} drops blocks at random in training ({', '.join(found)}: LayerDrop): under strategy='twobp' "
            f"every pipeline stage runs the loop over {self.list_name} with its own random draws, so the stages would "
            f"disagree on which blocks ran and training would stop at a random step; set {names} = 0.0 before fit "
            f"(LayerDrop does not apply in evaluation)"
        )

    def _last_stage(self) -> LoopStage:
        """The last stage, which answers the model's call (:meth:`_resume`), when this rank built it."""
        stage = self._stages.get(self._stage_of[-1])
        if stage is None:
            raise RuntimeError("the model's call was answered on a rank that does not hold the last stage")
        return stage

    def bind(self, runner: Any) -> None:
        """The step runner (:class:`~lightning_twobp.lightning.step.StepRunner`): stages after the
        first re-run the step's code up to the model call through it."""
        self._runner = runner

    def describe(self, i: int) -> str:
        return f"layer {i} of {self.list_name} ({', '.join(self._groups[i].paths)})"

    def parts(self, layer: nn.Module) -> list[nn.Module]:
        return layer.parts() if isinstance(layer, LayerGroup) else [layer]

    def parameter_name(self, i: int, name: str) -> str:
        full = self._groups[i].path_of(name)
        prefix = f"{self.name}."
        return full[len(prefix) :] if full.startswith(prefix) else full

    def swap(self, replacements: Mapping[int, nn.Module]) -> dict[int, nn.Module]:
        old: dict[int, nn.Module] = {}
        for i, new in replacements.items():
            group = self._groups[i]
            old[i] = group if new is not group else self._occupant(next(p for p in group.paths if p in self._slots))
            block = group.paths.index(f"{self.list_name}.{i}")
            for k, path in enumerate(group.paths):
                if isinstance(group.parts()[k], LooseParameter):
                    continue  # below, once the block's placeholder is in
                if new is group:
                    module = group.parts()[k]
                elif (part := getattr(type(new), "part", None)) is not None:  # local_model._Remote: one per part
                    module = part(new, k, path, "" if k == block else self.registration_hint(path, before=k < block))
                else:
                    module = new if k == block else copy.copy(new)
                parent, attr = self._slots[path]
                setattr(parent, attr, module)
            for path, part in zip(group.paths, group.parts(), strict=True):
                if isinstance(part, LooseParameter) and new is group:
                    part.put_back()
                elif isinstance(part, LooseParameter):
                    part.set_aside(self._loose_stand_in(i, path))
        return old

    def _loose_stand_in(self, i: int, path: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """What a read of layer ``i``'s loose parameter gives while the layer is set aside: an Elsewhere, made as
        the block's placeholder answers a read of its tensors (on the device the model moved to, in its cast), at
        each run (:meth:`_running`: the model moves and casts after the cut)."""
        block = f"{self.list_name}.{i}"

        def stand_in(t: torch.Tensor) -> torch.Tensor:
            occupant = self._occupant(block)
            answer = getattr(type(occupant), "_answer", None)  # local_model._Remote's
            return answer(occupant, t, path) if answer is not None else elsewhere(t, path)

        return stand_in

    @contextmanager
    def intercept(self, call: Callable[..., Any]) -> Iterator[None]:
        """While open, calling the model calls ``call(index, *tensors)`` first: on the first stage
        that raises (the step stops there, its call captured); on the last stage it returns the
        hidden state the previous stage sent, and the model's forward runs the last stage's blocks
        and what comes after them, so the step goes on to the loss."""
        called = [0]
        installed = []
        for path, module in self.ancestors:
            installed.append((module, module.__dict__.get("forward", _MISSING)))
            module.__dict__["forward"] = self._model_call(module, path, call, called)
        try:
            yield
        finally:
            _uninstall(installed)

    # ------------------------------------------------------------------ the model call
    def _model_call(
        self, owner: nn.Module, path: str, call: Callable[..., Any], called: list[int]
    ) -> Callable[..., Any]:
        real = _real_forward(owner, owner.__dict__.get("forward", _MISSING))

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._active is not None:  # a nested module on the path, inside the model's own forward
                return real(*args, **kwargs)
            if called[0]:
                raise RuntimeError(
                    f"the step called {path or 'self'} a second time: under strategy='twobp' it must call the model "
                    f"once per step (the pipeline runs it once per micro-batch)"
                )
            called[0] += 1
            return self._capture_or_resume(owner, path, real, call, args, kwargs)

        return forward

    def _capture_or_resume(
        self, owner: nn.Module, path: str, real: Callable[..., Any], call: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
        self._check_not_collecting(path, kwargs)
        flat, spec = pytree.tree_flatten((args, kwargs))
        positions = [k for k, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        tensors = [flat[k] for k in positions]
        grads = [t for t in tensors if t.requires_grad]
        if grads:
            raise ValueError(
                f"an argument of {path or 'self'} requires grad: a module with parameters runs before it in the step"
                f"{_made_from(grads, self.root)}, which the pipeline cannot train; call that module inside the "
                f"model's forward (before the loop over {self.list_name})"
            )
        device = tensors[0].device if tensors else _device_of(owner)
        calls = self._step_calls()
        index = torch.full((), len(calls.calls), dtype=torch.long, device=device)
        try:
            value = call(index, *tensors)
        except BaseException:  # the first stage: the runner stops the step here
            leaves = [None if k in positions else x for k, x in enumerate(flat)]
            calls.calls.append(_Call(owner, spec, leaves, positions, tensors))
            raise
        return self._resume(path, real, args, kwargs, value, device)

    def _resume(
        self, path: str, real: Callable[..., Any], args: tuple, kwargs: dict, value: Any, device: torch.device
    ) -> Any:
        """The last stage: the model's own forward with the hidden state ``value`` the previous stage sent
        (the first stage's own inputs when one stage holds everything) injected at the stage's first block."""
        stage = self._last_stage()
        run = _Run(stage, (value if isinstance(value, tuple) else (value,)) if stage.first > 0 else None, device)
        with self._running(run):
            out = run.swapped_in(real(*args, **kwargs))
        if run.next != self.num_blocks:
            raise RuntimeError(
                f"{path or 'forward'} returned after calling {run.next} of the {self.num_blocks} blocks of "
                f"{self.list_name}: under strategy='twobp' the loop must call every block, in order, once"
            )
        bad = find_elsewhere(out)
        if bad is not None:
            raise ElsewhereError(
                f"{path or 'forward'} returned a value computed by {bad.where}, which runs on another pipeline stage "
                f"(per-block outputs collected by the loop: output_hidden_states=True, output_attentions=True, a "
                f"cache, a block that returns several values, or a U-Net's skip connections; values a forward hook "
                f"collects from every block, e.g. router logits for an auxiliary loss; a value a module before the "
                f"blocks computed, returned as it is (CLIP's image embeddings with its text layers pipelined); a "
                f"weight of a module on another stage used directly, e.g. a head tied by `h @ self.embed.weight.T`; or "
                f"a value made before the blocks and used after them that the last stage's blocks are not given, so "
                f"not sent: give it to them, as SD3 gives `temb`, or compute it after the loop): "
                f"under strategy='twobp' "
                f"only the last stage's values can be returned; turn those outputs off (an auxiliary loss of every "
                f"block's values cannot be pipelined), and tie a head as a module of its own (`self.head = "
                f"nn.Linear(...); self.head.weight = self.embed.weight`, called after the loop)"
            )
        return out

    def _check_not_collecting(self, path: str, kwargs: dict) -> None:
        """Refuse a call that collects values from every block when the blocks are on several stages:
        Hugging Face collects them by hooks inside the blocks, which a block of another stage does not run,
        so the collection would silently hold only the last stage's blocks (Mixtral's auxiliary loss)."""
        asked = _collecting(self.ancestors, kwargs) if self._stage_of[-1] > 0 else []
        if not asked:
            return
        flags = " and ".join(sorted({a.split("=")[0] for a in asked}))
        raise ValueError(
            f"{path or 'self'} is asked to collect values from every block ({', '.join(asked)}): under "
            f"strategy='twobp' each pipeline stage runs only its own blocks, so what the model collects from them "
            f"(attentions, hidden states, a mixture of experts' router logits and the auxiliary load-balancing loss "
            f"computed from them) would hold only the last stage's blocks, a silently wrong value; set {flags}=False"
            + ("; the router's auxiliary loss is then left out" if "output_router_logits" in flags else "")
        )

    def captured_call(self, index: int) -> _Call:
        """Micro-batch ``index``'s call of the model, as the step made it (captured by the step runner)."""
        return self._step_calls().calls[index]

    def _step_calls(self) -> _Calls:
        if self._runner is None:
            raise RuntimeError("the ModuleList contract needs the step runner: StepRunner binds it (contract.bind)")
        state = self._runner.state
        if self._calls is None or self._calls.state is not state:
            self._calls = _Calls(state)
        return self._calls

    # ------------------------------------------------------------------ a stage's run
    def run_stage(self, stage: LoopStage, inputs: tuple) -> Any:
        calls = self._step_calls()
        for i in range(len(calls.calls), len(calls.state.microbatches)):  # stages after the first capture here
            self._runner.capture(i)
        calls.check(self.name)
        if stage.first == 0:
            index, tensors = inputs[0], inputs[1:]
            owner = calls.calls[0].owner
            args, kwargs = calls.calls[0].rebuild(tensors)
            inject = None
        else:
            inject, index = tuple(inputs[:-1]), inputs[-1]
            owner, args, kwargs = calls.select(index)
        run = _Run(stage, inject, index.device)
        with self._running(run):
            try:
                owner(*args, **kwargs)
            except _Stop as stop:
                carried = stop.carried if len(stop.carried) == 1 else (*stop.carried, stage.at(stop.positions, index))
            else:
                raise RuntimeError(
                    f"the model's forward returned before calling block {stage.stop} of {self.list_name}, where "
                    f"pipeline "
                    f"stage {stage.index}'s layers end: under strategy='twobp' the loop must call "
                    f"every "
                    f"block, in order, once"
                )
        # The index is passed on as a copy, an output of this stage's own rather than its input handed through.
        if stage.stop < stage.last_first:
            return (*carried, index.clone())
        return carried[0] if len(carried) == 1 else carried

    @contextmanager
    def _running(self, run: _Run) -> Iterator[_Run]:
        for loose in self._loose:  # their stand-ins in the device and cast the model has now
            loose.refresh()
        installed = []
        for i in range(self.num_blocks):
            block = self.blocks[i]
            self._previous[i] = block.__dict__.get("forward", _MISSING)
            installed.append((block, self._previous[i]))
            block.__dict__["forward"] = self._block_calls[i]
        if run.first == 0 and run.stop < self.num_blocks:  # what the modules before the blocks make is sent on
            for path in self._groups[0].paths:
                if path != f"{self.list_name}.0" and path in self._slots:
                    for module in _callables(self._occupant(path)):
                        installed.append((module, module.__dict__.get("forward", _MISSING)))
                        module.__dict__["forward"] = _kept(_real_forward(module, installed[-1][1]), run)
        if run.first > 0 and run.stop == self.num_blocks:
            # The modules after the blocks get the values this stage received where the forward gives them its
            # placeholders: SD3's and Flux's `norm_out(h, temb)`, `temb` made before the loop and given to
            # every block, so sent beside the hidden state (refused as computed elsewhere before)
            for path in self._groups[-1].paths:
                if path != f"{self.list_name}.{self.num_blocks - 1}" and path in self._slots:
                    for module in _callables(self._occupant(path)):
                        installed.append((module, module.__dict__.get("forward", _MISSING)))
                        module.__dict__["forward"] = _given_received(_real_forward(module, installed[-1][1]), run)
        for i, group in enumerate(self._groups):
            if run.first <= i < run.stop:
                continue
            for path, part in zip(group.paths, group.parts(), strict=False):
                if path != f"{self.list_name}.{i}" and path in self._slots:  # a loose part: its holder answers
                    occupant = self._occupant(path)
                    installed.append((occupant, occupant.__dict__.get("forward", _MISSING)))
                    occupant.__dict__["forward"] = self._absent(path, part, i, run)
                    if "_parts" in occupant.__dict__:  # a placeholder (local_model._Remote): its submodules' calls
                        installed.append((occupant, _CALLS))
                        occupant.__dict__["_calls"] = self._absent_within(path, part, i, run)
        self._active = run
        try:
            yield run
        finally:
            self._active = None
            _uninstall(installed)

    def _block_call(self, i: int) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            run = self._active
            if run is None or i != run.next:
                expected = "none (the model's forward has returned)" if run is None else str(run.next)
                raise RuntimeError(
                    f"{self.list_name}[{i}] was called when block {expected} was next: under strategy='twobp' the loop "
                    f"must call every block in order, once per step; a loop that skips, repeats or reorders blocks (by "
                    f"the data, the RNG or a setting, e.g. LayerDrop) is not supported"
                )
            run.next += 1
            if not args:  # diffusers' SD3 and Flux: `block(hidden_states=h, temb=temb)`
                args, kwargs = _hidden_first(self.blocks[i], self._previous[i], kwargs)
            if not args or not isinstance(args[0], torch.Tensor):
                raise TypeError(
                    f"{self.list_name}[{i}] was called without a tensor as its first positional argument: under "
                    f"strategy='twobp' a block takes the hidden state first, by position or by the name of its "
                    f"forward's first parameter (then any keyword side inputs)"
                )
            if i < run.first:
                return self._skipped(i, args, kwargs, run)
            if i == run.first and run.inject is not None:
                args, kwargs = self._received(i, args, kwargs, run)
            else:
                args, kwargs = run.swapped(args, kwargs)
            if i == run.stop:
                raise _Stop(*self.carried(i, args, kwargs, run))
            bad = find_elsewhere((args, kwargs))
            if bad is not None:
                self._check_real(i, bad, "the hidden state entering it" if bad is args[0] else "an argument of it")
            out = _real_forward(self.blocks[i], self._previous[i])(*args, **kwargs)
            self._shapes[self._key(i, args, kwargs)] = _structure(out)  # the real one, over a guess
            run.keep(out)
            return out

        return forward

    def carried(self, i: int, args: tuple, kwargs: dict, run: _Run) -> tuple[tuple[torch.Tensor, ...], list[int]]:
        """What a stage sends on at the next stage's first block ``i``, and where in that block's call (flattened)
        each goes: the hidden state (its first argument), then every other tensor argument made on this stage
        (returned by its blocks or received; on the first stage also returned by the modules before the blocks).
        So a block that returns several hidden states (``h, residual = block(h, residual)``) and an encoder's
        output that every decoder block reads (``block(h, encoder_hidden_states=memory)``) reach the next stage
        (:meth:`_received`). A value received is passed on as a copy, an output of this stage's graph like the
        others: B then returns for it this stage's own gradient plus the one the next stage sent back."""
        flat, _ = _flat(args, kwargs)
        self._check_real(i, flat[0], "the hidden state entering it")
        positions = [0]
        for k, x in enumerate(flat[1:], 1):
            if isinstance(x, Elsewhere):
                self._check_real(i, x, "an argument of it")
            if isinstance(x, torch.Tensor) and id(x) in run.made:
                positions.append(k)
        passed = {id(t) for t in run.inject or ()}
        return tuple(flat[k].clone() if id(flat[k]) in passed else flat[k] for k in positions), positions

    def _received(self, i: int, args: tuple, kwargs: dict, run: _Run) -> tuple[tuple, dict]:
        """The stage's first block ``i`` with the values the previous stage sent (its :meth:`carried`) in their
        places: the hidden state as the first argument, each other one where this stage's run of the forward
        holds its placeholder, which the stage's later blocks get it for too (:meth:`_Run.swapped`). Where this
        stage computed a value of its own there (a stand-in's output made from the batch's shapes, or drawn at
        random) the sent one is used all the same: it is the value one process computes with. An Elsewhere
        nothing was sent for is refused by name at the block's call; a placeholder whose value was received
        refuses in-place changes (they would not reach the value)."""
        assert run.inject is not None
        flat, spec = _flat(args, kwargs)
        values, positions = run.stage.unpacked(run.inject, spec)
        if positions[-1] >= len(flat):
            raise RuntimeError(
                f"{self.list_name}[{i}] is given {len(flat)} values on this pipeline stage but the previous stage "
                f"sent one for argument {positions[-1]} (flattened): the model's forward called it differently on "
                f"the two stages"
            )
        out = list(flat)
        for k, value in zip(positions, values, strict=True):
            x = flat[k]
            if k > 0 and isinstance(x, Elsewhere) and x.shape != value.shape:
                raise RuntimeError(
                    f"{self.list_name}[{i}]: argument {k} (flattened) is a value of shape {tuple(x.shape)} from "
                    f"{x.where} on this pipeline stage, but the previous stage sent one of shape {tuple(value.shape)} "
                    f"for it: the model's forward called the block differently on the two stages{self._guess_hint()}"
                )
            if isinstance(x, Elsewhere):
                x.received = True
            if isinstance(x, torch.Tensor):
                run.received[id(x)] = (x, value, tensor_version(x))
            # the stage's input, a leaf that requires grad: a block that changes it in place at once gets a copy
            out[k] = value.clone() if k == 0 and starts_in_place(self.blocks[i]) else value
        run.keep(values)
        return pytree.tree_unflatten(out, spec)

    def _guess_hint(self) -> str:
        """Why a block call may differ between stages: a block of another stage that does not run on the meta
        device is taken to return one tensor like its hidden state, which a block returning several is not."""
        if not self._guessed:
            return ""
        i, why = next(iter(self._guessed.items()))
        return (
            f" ({self.list_name}[{i}], of another stage, does not run on the meta device ({why}), so its output was "
            f"taken to be one tensor like its hidden state: a block that returns several values (a residual stream) "
            f"must run on meta to be pipelined, i.e. without kernels that have no meta implementation)"
        )

    def _check_real(self, i: int, x: Any, what: str) -> None:
        if isinstance(x, Elsewhere):
            raise ElsewhereError(
                f"{what} ({self.list_name}[{i}]) was computed by {x.where}, or from its output outside any module, "
                f"which is not on this pipeline stage: under strategy='twobp' what passes between stages is the hidden "
                f"state and the other values the next stage's first block is given as they came out of a block or out "
                f"of a module called before the blocks (several hidden states, an encoder's output given to every "
                f"block); a value given to later blocks only (one per block, made before the loop), or computed "
                f"outside a module (`scale = h.mean()`, `memory * 2`, Zamba's `torch.clone(inputs_embeds)` for its "
                f"shared blocks), is not sent: compute it inside the block or module that uses it. Other side inputs "
                f"must come from the batch (masks, positions, rotary embeddings). Not supported: blocks that hand "
                f"values to later blocks through a side input they write into (e.g. Gemma4's keys and values shared "
                f"across layers, num_kv_shared_layers > 0), and modules with parameters between blocks: they run "
                f"either before the loop (called before {self.list_name}: the first stage) or after it (called "
                f"after: the last stage)"
            )

    def _key(self, i: int, args: tuple, kwargs: dict) -> tuple:
        """A block call's signature for the cache of its output's structure: the call's structure, every tensor
        argument's shape, dtype and device (T5's cross-attention bias follows the encoder's length, not the
        hidden state's), the plain values (flags, sizes), the mode."""
        leaves, spec = _flat(args, kwargs)
        values = tuple(
            (tuple(x.shape), x.dtype, x.device)
            if isinstance(x, torch.Tensor)
            else x
            if x is None or isinstance(x, (bool, int, float, str))
            else type(x)
            for x in leaves
        )
        return (i, spec, values, self.root.training, torch.is_grad_enabled())

    def _skipped(self, i: int, args: tuple, kwargs: dict, run: _Run) -> Any:
        """What a block before this stage's first returns here: its output's structure, every tensor an
        Elsewhere. Learned from the block's own run on this rank, or once from its meta twin; where the
        twin cannot run, taken to be like the hidden state the block is given (see :meth:`_twin_output`)."""
        key = self._key(i, args, kwargs)
        if key not in self._shapes or _shared_dicts(args, kwargs) or (key not in self._twin_ran and self._hooked(i)):
            # A dict every block is given may carry values from block to block (Gemma4's keys and values shared
            # across layers): the twin runs each time then, so that what it leaves there is an Elsewhere that a
            # later block of this stage refuses to compute with. A forward hook in the block may collect its
            # values (a router's logits, for an auxiliary loss): the twin runs once then, its hook leaving an
            # Elsewhere that the loss refuses, at the first micro-batch. With the shape known (the block ran for
            # real on this rank: the V's first and last stage), the dict stayed empty, or the hook's list
            # short, and the stage silently took another branch (or raised a bare KeyError)
            self._twin_ran.add(key)
            self._shapes[key] = _structure(self._twin_output(i, args, kwargs))
        return _placeholders(
            *self._shapes[key], f"{self.list_name}[{i}] (pipeline stage {self._stage_of[i]})", run.device
        )

    def _hooked(self, i: int) -> bool:
        """Whether a module of block ``i`` holds a forward hook or pre-hook (its twin is a deep copy: hooks
        included), whose side effects one process would see on every stage. Asked each time: a user may
        register one between Trainer calls."""
        return any(forward_hooks(m) for m in self._block_part(i).modules())

    def _twin_output(self, i: int, args: tuple, kwargs: dict) -> Any:
        """Block ``i``'s output on Elsewhere inputs, from its meta twin. The meta device cannot run every
        block: torch's ``grouped_mm`` (Hugging Face's mixture-of-experts layers) wants bf16 there, and a
        block may read its routing on the host. Then the output is taken to be like the hidden state the
        block is given. A wrong guess cannot give a wrong answer: what the loop derives from it is an
        Elsewhere too, refused where it would reach this stage's compute, the stage's first block is
        handed the received hidden state whatever the loop passes it, and a value received beside it must
        have its placeholder's shape (:meth:`_received`, whose refusal then names this block: ``_guessed``). A
        write into this stage's tensors (shared state between blocks) is refused as before."""
        # Every tensor the twin makes is block i's: its inputs are relabelled, so a value it leaves outside its
        # output (into a dict every block is given: Gemma4's KV sharing across layers) names the block where a
        # later block of this stage reads it, not the embedding the hidden state came from
        where = f"{self.list_name}[{i}] (pipeline stage {self._stage_of[i]})"
        a, k = pytree.tree_map(
            lambda x: (
                Elsewhere(x._meta, x.device, where)
                if isinstance(x, Elsewhere)
                else elsewhere(x, where)
                if isinstance(x, torch.Tensor)
                else x
            ),
            (args, kwargs),
            # a dict or list side input is the model's own, not a copy (see _skipped); the keywords are not one
            is_leaf=_containers_but(kwargs),
        )
        try:
            with torch.no_grad(), _standing_in(_shared_dicts(args, kwargs), where), StandIn(where):
                return self._twin(self._block_part(i), f"{self.list_name}.{i}")(*a, **k)
        except ElsewhereWrite:
            raise
        except Exception as e:
            log.debug("%s[%d] does not run on the meta device (%s: %s)", self.list_name, i, type(e).__name__, e)
            self._guessed[i] = f"{type(e).__name__}: {e}"
            return a[0]

    def _block_part(self, i: int) -> nn.Module:
        group = self._groups[i]
        return group.parts()[group.paths.index(f"{self.list_name}.{i}")]

    def _absent_within(self, path: str, part: nn.Module, layer: int, run: _Run) -> Callable[..., Any]:
        """The calls of the submodules of a module of another stage (``self.altup_projections[0](h)``,
        ``self.embeddings.word_embeddings(ids)``), as :meth:`_absent` answers the module's own."""
        return lambda module, where: self._absent(path, part, layer, run, module, where)

    def _absent(
        self, path: str, part: nn.Module, layer: int, run: _Run, module: nn.Module | None = None, sub: str = ""
    ) -> Callable[..., Any]:
        """A module of another stage, called during this stage's run: its outputs as Elsewhere values,
        from its meta twin (no memory, no compute). ``module`` (named ``sub``) is a submodule of it."""
        where = f"{sub or path} (pipeline stage {self._stage_of[layer]})"
        target = part if module is None else module
        paths = self._groups[layer].paths
        before = paths.index(path) < paths.index(f"{self.list_name}.{layer}")  # placed before the blocks

        def forward(*args: Any, **kwargs: Any) -> Any:
            if (run.next > 0) if before else (run.next < self.num_blocks):
                raise self._misplaced(path, before, run)
            # The stand-in runs once per signature of the call: an encoder's is a whole meta forward (tens of ms
            # of Python a micro-batch, on every later stage's F, and its matmuls counted by the monitor's FLOPs)
            key = self._key(-1, args, kwargs) + (sub or path, self._twin_cast(path))
            known = self._absent_out.get(key)
            if known is not None:
                return _placeholders(*known, where)
            a, k = pytree.tree_map(lambda x: elsewhere(x, where) if isinstance(x, torch.Tensor) else x, (args, kwargs))
            try:
                with torch.no_grad(), StandIn(where):
                    out = self._twin(target, path, run.device, where)(*a, **k)
                # Every tensor output is this module's, named for it (one computed from the embedding's placeholder
                # was named for the embedding, which a refusal then blamed); one made from the twin's own meta
                # weights alone (BART's positions: an arange on the weight's device) is plain meta: an Elsewhere
                # too, on this stage's device.
                out = pytree.tree_map(
                    lambda x: (
                        Elsewhere(x._meta, x.device, where)  # on its device (meta, in twobp-plan's runs)
                        if isinstance(x, Elsewhere)
                        else Elsewhere(x, run.device, where)
                        if isinstance(x, torch.Tensor) and x.is_meta
                        else x  # real: made from the batch's shapes alone
                    ),
                    out,
                )
                if _cacheable(out, args, kwargs, target):
                    self._absent_out[key] = _structure(out)
                return out
            except ElsewhereError:
                raise
            except Exception as e:
                raise RuntimeError(
                    f"{sub or path} runs on pipeline stage {self._stage_of[layer]}; to stand in for it on stage "
                    f"{run.stage.index} it runs on the meta device, which failed ({type(e).__name__}: {e})"
                ) from e

        return forward

    def _misplaced(self, path: str, before: bool, run: _Run) -> RuntimeError:
        """A module placed on one side of the blocks but called on the other (:meth:`misplaced_fix`)."""
        called = f"after {self.list_name}[{run.next - 1}]" if run.next else f"before {self.list_name}[0]"
        return RuntimeError(
            f"{path} is called {called} in the model's forward, but {self.placed(path, before)}; "
            f"{self._stage_label(run.stage.index)} runs that call without it. To fix it, "
            f"{self.misplaced_fix(path, before)}"
        )

    def _stage_label(self, k: int) -> str:
        """Stage ``k`` in a message: while the layers are profiled (one_stage_per_layer), layer k's own."""
        if self._profiling:
            return (
                f"layer {k} run alone (schedule='auto' and balance='time' run each layer as a stage of its own before "
                f"the pipeline is cut)"
            )
        return f"pipeline stage {k}"

    def _twin(self, module: nn.Module, path: str, device: torch.device | None = None, where: str = "") -> nn.Module:
        """``module`` with every tensor on the meta device (a structural copy: no data is copied), its floating
        tensors in the dtype the model was cast to since ``module`` was set aside (bf16 under "bf16-true":
        an fp32 twin made Llama's rotary embeddings fp32 on the other stages, against bf16 values). With
        ``device`` (a module of another stage standing in), its buffers are :class:`Elsewhere` values on that
        device, as its inputs are: a forward that moves a buffer to an input's device (RoBERTa's embeddings,
        ``self.token_type_ids.to(position_ids.device)``) failed with "Cannot copy out of meta tensor"."""
        cast = self._twin_cast(path)
        # under autocast its weights stand in on the device too (below); elsewhere they stay meta, as a plan's
        # model is (a forward moving a meta buffer to an Elsewhere's device failed in twobp-plan otherwise)
        autocast = device is not None and torch.is_autocast_enabled(device.type)
        key = (id(module), cast, None if device is None else str(device), autocast)
        twin = self._twins.get(key)
        if twin is None:
            memo: dict[int, Any] = {}
            for t in [*module.parameters(), *module.buffers()]:
                meta = torch.empty_like(t, device="meta", dtype=cast if cast and t.is_floating_point() else t.dtype)
                if isinstance(t, nn.Parameter):
                    # standing in under autocast, an Elsewhere on the device as its inputs are: autocast casts
                    # what is on its device, so a meta weight beside a cast input failed a conv's dtype check
                    # under bf16-mixed (ViT's, DINOv2's, ConvNeXt's patch embeddings) and gave a Linear's
                    # output the wrong dtype
                    data = Elsewhere(meta, device, where) if autocast and device is not None else meta
                    memo[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad)
                else:
                    memo[id(t)] = meta if device is None else Elsewhere(meta, device, where)
            twin = without_installed_forwards(copy.deepcopy(module, memo))
            self._twins[key] = twin
        return twin

    def _twin_cast(self, path: str) -> torch.dtype | None:
        """The dtype the twins of the module at ``path`` take (see :meth:`_twin`)."""
        from lightning_twobp.lightning.local_model import float_cast  # local_model imports the contracts

        return float_cast(self._occupant(path)) or self._cast

    def _occupant(self, path: str) -> nn.Module:
        parent, attr = self._slots[path]
        return _child(parent, attr)


# ---------------------------------------------------------------------------------------------- helpers
# Hugging Face's flags for outputs collected from every block (see ModuleListContract._check_not_collecting)
_COLLECTED = ("output_attentions", "output_hidden_states", "output_router_logits")


def _collecting(ancestors: list[tuple[str, nn.Module]], kwargs: dict) -> list[str]:
    """The ``_COLLECTED`` flags a model call turns on: in its keyword arguments, else in the ``config`` of
    a module on the path to the blocks (Mixtral's ``output_router_logits=True``)."""
    asked = [f"{k}={v!r}" for k, v in kwargs.items() if k in _COLLECTED and v not in (None, False)]
    for path, config in _configs(ancestors):
        for k in _COLLECTED:
            if k not in kwargs and getattr(config, k, None) not in (None, False):
                asked.append(f"{k}={getattr(config, k)!r} in {path + '.' if path else ''}config")
    return asked


def _configs(ancestors: list[tuple[str, nn.Module]]) -> Iterator[tuple[str, Any]]:
    """Each distinct ``config`` of a module on the path to the blocks, with the first such module's path
    (a Hugging Face model and its base model share one)."""
    seen: set[int] = set()
    for path, module in ancestors:
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen:
            seen.add(id(config))
            yield path, config


def _shared_dicts(args: tuple, kwargs: dict) -> list[MutableMapping | list]:
    """A block's side inputs that are mutable mappings or lists, through which blocks can hand values on (a
    list every block appends its auxiliary loss to: the skipped blocks' twins append placeholders, which the
    stage's first block then refuses, where the loss summed this stage's blocks' entries alone)."""
    return [v for v in (*args[1:], *kwargs.values()) if isinstance(v, (MutableMapping, list))]


@contextmanager
def _standing_in(dicts: list[MutableMapping | list], where: str) -> Iterator[None]:
    """The real tensors of the model's dicts that a meta twin is handed, as Elsewhere values while it runs
    (then put back where the twin left them): its meta weights times a real tensor came out as a real tensor
    of uninitialised memory (torch's CPU matmul by a meta tensor), which it left in the dict for this stage's
    later blocks to compute with, silently."""
    swapped: list[tuple[Any, Any, Any, Any]] = []
    for d in dicts:
        for key, value in list(d.items()) if isinstance(d, MutableMapping) else list(enumerate(d)):
            leaves = pytree.tree_leaves(value)
            if any(isinstance(t, torch.Tensor) and not isinstance(t, Elsewhere) for t in leaves):
                # a tensor, or tensors in a tuple (a list of (key, value) pairs)
                d[key] = stand_in = pytree.tree_map(
                    lambda t: elsewhere(t, where) if isinstance(t, torch.Tensor) else t, value
                )
                swapped.append((d, key, value, stand_in))
    try:
        yield
    finally:
        for d, key, value, stand_in in swapped:
            if (d.get(key) if isinstance(d, MutableMapping) else d[key] if key < len(d) else None) is stand_in:
                d[key] = value


def _layerdrop(ancestors: list[tuple[str, nn.Module]]) -> list[str]:
    """The LayerDrop settings above 0 that the loop reads: a ``layerdrop`` attribute of a module on the path
    to the blocks (BART's and Whisper's encoders copy theirs from the config when built, so only it counts
    there), else ``config.layerdrop`` (Wav2Vec2's encoder reads the config at every call)."""
    held = [(path, module.__dict__["layerdrop"]) for path, module in ancestors if "layerdrop" in module.__dict__]
    if held:
        return [f"{path + '.' if path else ''}layerdrop={v!r}" for path, v in held if _positive(v)]
    found = [(path, getattr(config, "layerdrop", None)) for path, config in _configs(ancestors)]
    return [f"{path + '.' if path else ''}config.layerdrop={v!r}" for path, v in found if _positive(v)]


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def _real_forward(module: nn.Module, previous: Any) -> Callable[..., Any]:
    """The module's forward as it was before this contract shadowed it."""
    if previous is not _MISSING:
        return previous
    return type(module).forward.__get__(module)


def _uninstall(installed: list[tuple[nn.Module, Any]]) -> None:
    for module, previous in reversed(installed):
        if previous is _CALLS:
            module.__dict__.pop("_calls", None)
        elif previous is _MISSING:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = previous


def _child(parent: nn.Module, name: str) -> nn.Module:
    child = parent._modules[name]
    assert child is not None  # torch types a child slot Optional; the ones read here hold a module
    return child


def _all_set(xs: list[_T | None]) -> TypeGuard[list[_T]]:
    return all(x is not None for x in xs)


def _placeholders(spec: Any, leaves: list[Any], where: str, device: torch.device | None = None) -> Any:
    """Fresh placeholders of a structure :func:`_structure` recorded, on ``device`` (default: each on the
    device it was recorded on: meta in twobp-plan's runs)."""
    return pytree.tree_unflatten(
        [
            Elsewhere(torch.empty(x[1], dtype=x[2], device="meta"), device or x[3], where) if _is_shape(x) else x
            for x in leaves
        ],
        spec,
    )


def _cacheable(out: Any, args: tuple, kwargs: dict, module: nn.Module) -> bool:
    """Whether a stand-in's output may be replayed from its structure: every tensor in it a placeholder (not
    a real value made from the batch's shapes), no dict or list handed to it to write into, no hook of the
    user's to run (it runs at the first call, as a skipped block's twin does)."""
    leaves = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    return (
        all(isinstance(x, Elsewhere) for x in leaves)
        and not _shared_dicts((None, *args), kwargs)
        and not any(forward_hooks(m) for m in module.modules())
    )


def _callables(module: nn.Module) -> list[nn.Module]:
    """``module``, or where it is a container the forward cannot call (``nn.ModuleList``, ``nn.ModuleDict``:
    modded-nanogpt's value embeddings, ``self.ve[i](ids)``) the modules in it, so found."""
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return [module]
    return [m for child in module.children() for m in _callables(child)]


def _kept(forward: Callable[..., Any], run: _Run) -> Callable[..., Any]:
    """``forward``, its floating-point outputs kept in ``run.made`` (a module before the blocks, on the first
    stage): an encoder's output is sent on; an integer or boolean one (position ids, a padding mask an
    embedding module returns) is not, as before values beside the hidden state travelled: made from the batch,
    the next stage's stand-in makes it too."""

    def kept(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        run.keep([t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()])
        return out

    return kept


def _hidden_first(block: nn.Module, previous: Any, kwargs: dict) -> tuple[tuple, dict]:
    """A block called by keywords alone, its hidden state by the name of its forward's first parameter: that one
    first, by position (as the block takes it), the others as they were. A block of another stage is a
    placeholder here, whose ``__class__`` answers as the block's."""
    if previous is _MISSING:  # the class's forward: its signature read once, not at every call
        first = _first_parameter(block.__class__.forward, skip=1)
    else:
        first = _first_parameter.__wrapped__(previous, skip=0)
    if first is None or first not in kwargs:
        return (), kwargs
    return (kwargs[first],), {k: v for k, v in kwargs.items() if k != first}


@functools.cache
def _first_parameter(forward: Callable[..., Any], skip: int) -> str | None:
    """The name of ``forward``'s first parameter after ``skip`` (``self``), where it can be given by position."""
    try:
        params = list(inspect.signature(forward).parameters.values())[skip:]
    except (TypeError, ValueError):  # no signature to read
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return params[0].name if params and params[0].kind in positional else None


def _given_received(forward: Callable[..., Any], run: _Run) -> Callable[..., Any]:
    """``forward`` with every placeholder in its arguments whose value this stage received swapped for it."""

    def given(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = run.swapped(args, kwargs)
        return forward(*args, **kwargs)

    return given


def _flat(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    """A block call's arguments, flattened; a dict or list side input is one leaf (the model's own, which a
    block may write into and a later block read: see ``_shared_dicts``), not rebuilt as a copy."""
    return pytree.tree_flatten((args, kwargs), is_leaf=_containers_but(kwargs))


def _containers_but(kwargs: dict) -> Callable[[Any], bool]:
    """pytree's ``is_leaf`` for a call's ``(args, kwargs)``: a dict or list the call is given is a leaf."""
    return lambda x: isinstance(x, (MutableMapping, list)) and x is not kwargs


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 4 and x[0] is _SHAPE


_SHAPE = object()


def _structure(out: Any) -> tuple[Any, list[Any]]:
    leaves, spec = pytree.tree_flatten(out)
    return spec, [(_SHAPE, tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else x for x in leaves]


def _device_of(module: nn.Module) -> torch.device:
    first = next(iter([*module.parameters(), *module.buffers()]), None)
    return first.device if first is not None else torch.device("cpu")


def _ancestors(root: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    out = [("", root)]
    module, prefix = root, ""
    for part in path.split(".")[:-1]:
        module = _child(module, part)
        prefix = f"{prefix}.{part}" if prefix else part
        out.append((prefix, module))
    return out


def without_installed_forwards(copied: nn.Module) -> nn.Module:
    """``copied`` (a copy of a module of the model) without the instance forwards this contract installed on the
    original: they are not the module's own, and call the original's modules."""
    for m in copied.modules():
        fwd = m.__dict__.get("forward")
        if fwd is not None and getattr(fwd, "__qualname__", "").startswith(ModuleListContract.__qualname__):
            del m.__dict__["forward"]
    return copied


def _slot(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent_path, _, attr = path.rpartition(".")
    return (root.get_submodule(parent_path) if parent_path else root), attr
