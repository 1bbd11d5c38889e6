"""Cutting the user's model into this rank's stages for one Trainer call, and putting it back.

For the length of a Trainer call the layers of other pipeline ranks are set aside: the contract's
layers are swapped for empty :class:`_Remote` placeholders (so ``configure_optimizers``,
``state_dict`` and checkpoints see this rank's parameters, under the full model's names) and the
set-aside layers keep their structure on the ``meta`` device (no memory). :meth:`LocalModel.restore`
undoes the swap in ``teardown``, after an exception too. Then the model is whole again: every rank's
``state_dict`` has every key. With ``gather=True`` the other ranks' trained weights are broadcast in
first; without it, those layers stay on ``meta`` and calling one raises an error that says where the
weights are and how to get them.

Parameters used by layers on several pipeline ranks (tied embeddings: ``wte`` on the first stage,
``lm_head`` on the last) are found here, before any compute; :mod:`lightning_twobp.lightning.grads`
keeps their copies in sync.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lightning_twobp.lightning.contract import Contract, SequentialContract
from lightning_twobp.lightning.placeholders import Elsewhere
from lightning_twobp.schedules import Schedule

__all__ = [
    "LocalModel",
    "SharedParameter",
    "drop_guards",
    "float_cast",
    "is_placeholder",
    "left_on_meta",
    "like",
    "meta_layers_aside",
    "named_own",
    "replace_tensors",
    "split_model",
]

_HOW_TO_GET_WEIGHTS = (
    "to have every rank hold all trained weights after the Trainer call, pass "
    "TwoBPStrategy(gather_full_model=True); or merge a checkpoint into one file with "
    "`twobp-consolidate CHECKPOINT_DIR model.ckpt` and load it with "
    "model.load_state_dict(torch.load('model.ckpt')['state_dict'], assign=True) (assign=True gives every name a "
    "Parameter of its own: tie tied weights again after it, e.g. `model.lm_head.weight = model.embed.weight`)"
)


# A layer of the Sequential called on its own: the model walks the layers itself (timm's checkpoint_seq).
_ONE_CALL = (
    ", as one call of the whole nn.Sequential per step; this call is of one of its layers, by the model's own "
    "code (a loop over the layers, or timm's checkpoint_seq under set_grad_checkpointing(): turn that off and "
    "pass TwoBPStrategy(activation_checkpointing='full') for the same memory)"
)


class _Remote(nn.Module):
    """Stands in, during a Trainer call, for a layer that lives on another pipeline rank.

    Calling it raises. Reading an attribute answers from the set-aside layer (on the meta device), as
    model code reads its modules' settings between the calls: nn.TransformerEncoder reads
    ``self.layers[0].self_attn.batch_first``, Hugging Face's ViT ``...projection.weight.dtype``, Swin
    ``layer.downsample is not None``. A submodule is answered by another ``_Remote``; a tensor by an
    :class:`~.placeholders.Elsewhere` (its shape, dtype and device, no data: computing with it on this
    stage raises, naming where it lives); anything else (flags, sizes, configs) as it is."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Remote:
        # Iterable (and sized) only where the layer is: BaseFinetuning.flatten_modules iterates what is
        # Iterable, and a placeholder of a Linear that claimed to be raised TypeError on another stage.
        # (No arguments: a copy being made, of the class it was.)
        parts = args[2] if len(args) > 2 else kwargs.get("parts")
        container = cls is _Remote and parts is not None and isinstance(parts[0], Iterable)
        return super().__new__(_RemoteContainer if container else cls)

    def __init__(
        self, stage: int, rank: int, parts: list[nn.Module], device: torch.device, where: str, hint: str = ""
    ) -> None:
        """``hint`` ends the message of a call to it."""
        super().__init__()
        self.stage, self.rank = stage, rank
        # Not registered as submodules: the set-aside layers must stay out of parameters() and state_dict.
        self.__dict__.update(_parts=parts, _part=0, _device=device, _float=None, _where=where, _hint=hint)
        self.__dict__["_origin"] = id(self)  # a copy (copy.deepcopy, pickle) carries another object's id

    # isinstance answers as the layer would: a hook that picks layers by type (`[m for m in self.layers if
    # isinstance(m, Block)][1].requires_grad_(False)`) builds the same list on every rank and freezes the same
    # block (it skipped the placeholders, so each rank froze another block, silently). type() still tells
    # a placeholder; copies are made by type, so they stay placeholders.
    @property  # type: ignore[misc]
    def __class__(self) -> type:
        parts = self.__dict__.get("_parts")
        return type(parts[self.__dict__["_part"]]) if parts else type(self)

    # pickle (torch.save of a checkpoint whose hyper_parameters hold the network) rebuilds an object by
    # copyreg.__newobj__, which refuses one whose __class__ is not its type: rebuild it by its type.
    def __reduce_ex__(self, protocol: Any) -> Any:
        return _new_placeholder, (type(self),), self.__dict__

    def part(self, k: int, where: str, hint: str = "") -> _Remote:
        """The placeholder for part ``k`` of the layer (the ModuleList contract's embedding, final norm);
        ``hint`` ends the message of a call to it."""
        return self._child(self.__dict__["_parts"][k], where, hint)

    def _child(self, module: nn.Module, where: str, hint: str = "") -> _Remote:
        """A placeholder for ``module``, a part of this one's, knowing the casts and moves this one saw; while
        the ModuleList contract stands in for this one's calls (``_calls``), for the child's calls too."""
        remote = _Remote(self.stage, self.rank, [module], self.__dict__["_device"], where, hint)
        remote.__dict__["_float"] = self.__dict__["_float"]
        remote.__dict__["_current"] = self.__dict__.get("_current")
        calls = self.__dict__.get("_calls")
        if calls is not None:
            remote.__dict__.update(_calls=calls, forward=calls(module, where))
        return remote

    def _answer(self, value: Any, where: str) -> Any:
        """What a read of the set-aside layer gives here: a module as a placeholder, a tensor as Elsewhere."""
        if isinstance(value, nn.Module):
            return self._child(value, where)
        if isinstance(value, nn.Parameter) and (held := self._held(value)) is not None:
            # kept when set aside: a stage of this rank uses it too (a tied weight: wte's set aside beside
            # lm_head's here). The rank's own copy, so that what the model's code does to it here acts on it:
            # `wte.weight.requires_grad_(False)` froze a meta stand-in on the last stage, whose copy trained on
            # (0.027 off one process after one step), silently
            return held
        if isinstance(value, torch.Tensor):
            dtype = self.__dict__["_float"] if value.is_floating_point() and self.__dict__["_float"] else value.dtype
            meta = torch.empty_strided(value.shape, value.stride(), dtype=dtype, device="meta")
            return Elsewhere(meta, self.__dict__["_device"], f"{where} (pipeline stage {self.stage})")
        return value

    def _held(self, q: nn.Parameter) -> nn.Parameter | None:
        """The Parameter this rank's stages train for ``q``, a tied weight kept in the set-aside layer: ``q``, or
        its DTensor shard under data_parallel="shard" (where ``q``, the user's, holds no values during the call:
        answered as it was, it read as zeros and froze nothing); None for another (one set aside on the meta device,
        or any in a copy of the placeholder): ``current`` holds the kept ones only."""
        current = self.__dict__.get("_current")
        return current.get(id(q)) if current is not None else None

    # A container of another stage (ModuleList, Sequential, ModuleDict, ParameterList) indexed, sliced or
    # iterated by the model's code: Gemma3n's `self.altup_projections[i - 1](h)`, MusicGen's embedding per
    # codebook, before the loop, on every stage ("'_Remote' object is not subscriptable" on the others).
    def _container(self) -> Any:
        return self.__dict__["_parts"][self.__dict__["_part"]]

    def __getitem__(self, key: Any) -> Any:
        return self._answer(self._container()[key], f"{self.__dict__['_where']}[{key!r}]")

    def __bool__(self) -> bool:  # a module is true (torchtitan's `if self.norm:`), whatever its length
        return True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get("_origin", id(self)) != id(self):
            raise RuntimeError(
                f"{self.__dict__['_where']} is called in a copy of the model made during a Trainer call under "
                f"strategy='twobp' (copy.deepcopy of the LightningModule or its model: an EMA such as timm's "
                f"ModelEmaV3 made in a callback's on_fit_start, or a teacher): the copy holds this rank's stages "
                f"only, and {self.__dict__['_where']} there is a placeholder for the layer pipeline rank "
                f"{self.rank} (stage {self.stage}) trained, without weights. gather_full_model=True gathers the "
                f"model, not such copies: a copy of the whole model cannot be kept up to date under the pipeline; "
                f"each rank's copy holds its own stages' tensors (an EMA of them exactly as one process's), which "
                f"a hook after fit can gather by name from the ranks of the pipeline"
            )
        raise RuntimeError(
            f"{self.__dict__['_where']} belongs to pipeline stage {self.stage} on pipeline rank {self.rank} and is "
            f"called here outside the pipeline's run of that stage; under strategy='twobp' each stage's layers run "
            f"on their own stage, inside the step's call of the pipelined model{self.__dict__['_hint']}. A part of a "
            f"block that the model's forward also calls outside its loop over the blocks (diffusers' DiT calls "
            f"transformer_blocks[0].norm1.emb after them) is on that block's stage only: give the forward a module of "
            f"its own for that call, outside the blocks, holding the block's parameters (`out = copy.deepcopy(part)`, "
            f"then each of its parameters set to the part's, `out.linear_1.weight = part.linear_1.weight`): a "
            f"parameter used on two stages is kept in sync, as tied embeddings are"
        )

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            parts = self.__dict__.get("_parts")
            if not parts or (name.startswith("__") and name.endswith("__")):
                raise
            value = getattr(parts[self.__dict__["_part"]], name)  # the layer's own AttributeError if absent
        return self._answer(value, f"{self.__dict__['_where']}.{name}")

    # A tied weight one of this rank's stages uses is kept when its layer is set aside (wte's, beside lm_head's
    # here): the rank's copy. Freezing the layer by the module or by its parameters freezes that copy, as it
    # freezes the one parameter in one process (`wte.requires_grad_(False)`, `for p in wte.parameters(): ...`
    # left lm_head's copy training, silently). The others, on the meta device, are not listed: no values here.
    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        parts = self.__dict__.get("_parts")
        if not parts:
            return
        # recurse=False too: a walk over the modules (BaseFinetuning.freeze: each leaf's parameters(recurse=False))
        # meets no submodule of a placeholder, which stands for the whole layer (a tied weight in a submodule of
        # it, BERT's embeddings.word_embeddings, was left training)
        named = parts[self.__dict__["_part"]].named_parameters(prefix, True, remove_duplicate)
        for n, q in named:
            held = self._held(q)
            if held is not None:
                yield n, held

    def requires_grad_(self, requires_grad: bool = True) -> _Remote:
        parts = self.__dict__.get("_parts")
        if parts:  # the set-aside layer's flags too: the model put back after the call carries them
            layer = parts[self.__dict__["_part"]]
            layer.requires_grad_(requires_grad)
            for q in layer.parameters():
                held = self._held(q)
                if held is not None:
                    held.requires_grad_(requires_grad)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> _Remote:
        # Follow the model's moves and casts (Lightning's model_to_device, a precision's convert_module),
        # which do not reach the set-aside layer: a tensor read then reports where and how it would be.
        a, b = (fn(torch.empty(0, dtype=d, device=self.__dict__["_device"])) for d in (torch.float32, torch.float64))
        cast = a.dtype if a.dtype == b.dtype else None  # both made one dtype: a cast of floating tensors
        self.__dict__.update(_device=a.device, _float=cast or self.__dict__["_float"])
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"stage={self.stage}, rank={self.rank}"


class _RemoteContainer(_Remote):
    """The placeholder of an iterable layer (Sequential, ModuleList, ModuleDict, ParameterList): sized and
    iterated as the layer is; ``_Remote(...)`` makes one where the layer is iterable."""

    def __len__(self) -> int:
        return len(self._container())

    def __iter__(self) -> Any:
        container = self._container()
        if isinstance(container, (nn.ModuleDict, nn.ParameterDict)):
            return iter(container)  # the keys, as the container's own iteration gives
        return iter([self[k] for k in range(len(container))])


def is_placeholder(module: nn.Module) -> bool:
    """Whether ``module`` stands in for a layer of another pipeline rank (its ``__class__`` is the layer's)."""
    return issubclass(type(module), _Remote)


def _new_placeholder(cls: type[_Remote]) -> _Remote:
    """An empty placeholder of class ``cls``, for pickle to fill (``_Remote.__reduce_ex__``)."""
    return cls.__new__(cls)


def float_cast(module: nn.Module) -> torch.dtype | None:
    """The dtype the model's floating tensors were cast to after ``module``, a placeholder, stood in for a
    layer of another stage (bf16 under "bf16-true"), or None: the set-aside layer never saw that cast."""
    return module.__dict__["_float"] if isinstance(module, _Remote) else None


# Layers left on the meta device after a Trainer call -> the guard that explains a call to them.
_GUARDS: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def _guard(where: str) -> Any:
    def check(module: nn.Module, args: Any) -> None:
        if any(t.is_meta for t in _tensors(module)):
            raise RuntimeError(
                f"{where}: its weights are not on this rank (they are on the meta device); {_HOW_TO_GET_WEIGHTS}"
            )

    return check


def left_on_meta() -> set[int]:
    """The ids of the tensors an earlier Trainer call left on the meta device (the layers it guards)."""
    return {id(t) for part in list(_GUARDS) for t in _tensors(part)}


def drop_guards(tensor_ids: set[int]) -> None:
    """Drop the guards on layers whose every tensor is in ``tensor_ids``: a model built on the meta
    device, put back as it was built after a refused setup, is the user's again, to be made anew."""
    for part in list(_GUARDS):
        if all(id(t) in tensor_ids for t in _tensors(part)):
            _GUARDS.pop(part).remove()


def _unguard(contract: Contract, layers: Iterable[nn.Module]) -> None:
    """Drop the guards a previous Trainer call left on layers this one sets aside again: during the call
    placeholders stand in for them, and the ModuleList contract runs meta twins of them (deep copies,
    hooks included) to learn shapes, which a guard would refuse. ``restore`` guards them again."""
    for layer in layers:
        for part in contract.parts(layer):
            handle = _GUARDS.pop(part, None)
            if handle is not None:
                handle.remove()


def _device_of(layer: nn.Module) -> torch.device:
    """Where ``layer``'s tensors are; the CPU for one left on the meta device by an earlier call (the
    Trainer's move to the rank's device then tells its placeholder, ``_Remote._apply``)."""
    device = next(iter(_tensors(layer)), torch.empty(0)).device
    return torch.device("cpu") if device.type == "meta" else device


def _tensors(module: nn.Module) -> Iterable[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


@dataclass(frozen=True)
class SharedParameter:
    """A parameter that layers on several pipeline ranks use (tied weights)."""

    names: tuple[str, ...]  # its names in the contract, one per use ("0.weight", "5.weight" in a Sequential)
    ranks: tuple[int, ...]  # pipeline ranks holding a layer that uses it, ascending
    param: nn.Parameter | None  # this rank's copy, None when no local layer uses it


@dataclass
class LocalModel:
    """This rank's share of the contract's layers during one Trainer call."""

    contract: Contract
    sizes: list[int]  # layers per stage
    stages: dict[int, nn.Module]  # this rank's stage modules, by stage index
    removed: dict[int, nn.Module] = field(default_factory=dict)  # layer index -> the set-aside layer
    owner: dict[int, int] = field(default_factory=dict)  # layer index -> pipeline rank holding it
    shared: list[SharedParameter] = field(default_factory=list)
    # a tied weight kept in a set-aside layer (the user's Parameter, by id) -> the Parameter this rank's stages
    # train for it: itself, or its DTensor shard under data_parallel="shard" (:meth:`follow`); the placeholders
    # answer reads of it with that one
    current: dict[int, nn.Parameter] = field(default_factory=dict)

    def follow(self, replaced: dict[int, nn.Parameter]) -> None:
        """The placeholders answer each kept tied weight with ``replaced[id(it)]`` where given (the stages'
        DTensor shard), else with the user's Parameter itself (the stages hold it again)."""
        for layer in self.removed.values():
            for q in layer.parameters():
                if id(q) in self.current:
                    self.current[id(q)] = replaced.get(id(q), q)

    @property
    def bounds(self) -> list[int]:
        return _bounds(self.sizes)

    def blocks(self) -> list[tuple[int, nn.Module]]:
        """This rank's layers, with their index in the contract."""
        layers, b = self.contract.layers(), self.bounds
        return [(i, layers[i]) for s in sorted(self.stages) for i in range(b[s], b[s + 1])]

    def restore(self, gather: bool, group: dist.ProcessGroup | None, pp_rank: int, device: torch.device) -> None:
        """Put the set-aside layers back into the contract. With ``gather`` every pipeline rank
        first receives the trained weights of the layers it did not hold (one broadcast per tensor
        from the rank that trained it, layer by layer, each landing on the CPU right away)."""
        try:
            if gather:
                self._gather(group, pp_rank, device)
        finally:  # a gather refused (on every rank, before any broadcast) leaves the model whole all the same
            self._put_back()

    def _put_back(self) -> None:
        self.contract.swap(self.removed)
        for i, layer in self.removed.items():
            for part in self.contract.parts(layer):
                if any(t.is_meta for t in _tensors(part)) and part not in _GUARDS:
                    where = f"{self.contract.describe(i)} was trained on pipeline rank {self.owner[i]}"
                    _GUARDS[part] = part.register_forward_pre_hook(_guard(where))
        self.removed = {}

    def _gather(self, group: dist.ProcessGroup | None, pp_rank: int, device: torch.device) -> None:
        # Every tensor from the rank that trained its layer, as that rank holds it: the tensors it names, their
        # shapes and dtypes, and which are one tensor (ties), the owner's. The copies elsewhere were cut before
        # training and may differ: a buffer registered or dropped in a forward (litgpt's LoRA ``_lora_ind``), a
        # shared cache replaced in each layer; an order or ties each rank derived from its own layers paired
        # broadcasts of different tensors (gloo aborted, or both ranks waited).
        layers = [self.removed.get(i, layer) for i, layer in enumerate(self.contract.layers())]
        plan = _GatherPlan.agree(layers, self.owner, pp_rank, group)
        synced = {id(shared.param) for shared in self.shared if shared.param is not None}
        values: list[torch.Tensor] = []
        for k, (i, held) in enumerate(plan.order):
            owner, mine = self.owner[i], plan.local[i].get(held.name)
            tie = plan.ties[owner].get(k)
            src = dist.get_global_rank(group, owner) if group is not None else owner
            if tie is not None:  # the tensor of an earlier entry: nothing sent
                value = values[tie]
            elif owner == pp_rank:  # after teardown's move to the CPU: NCCL sends from the device
                value = cast(torch.Tensor, mine)
                dist.broadcast(value.detach().to(device), src=src, group=group)
            else:
                buf = torch.empty(held.shape, dtype=getattr(torch, held.dtype.removeprefix("torch.")), device=device)
                dist.broadcast(buf, src=src, group=group)
                # a parameter tied across ranks is this rank's own copy, kept equal by the step: it stays (and so
                # does its tie here); anything else is the owner's, a tensor this rank held since the cut included
                value = mine if mine is not None and id(mine) in synced else held.made(mine, buf.cpu())
            values.append(value)
            if owner != pp_rank and value is not mine:
                held.install(layers[i], value)
        for i, layer in enumerate(layers):  # what the owner no longer holds (a buffer set to None in training)
            if self.owner[i] != pp_rank:
                kept = {held.name for held in plan.held[self.owner[i]][i]}
                for name in plan.local[i].keys() - kept:
                    prefix, _, leaf = name.rpartition(".")
                    setattr(layer.get_submodule(prefix), leaf, None)


@dataclass(frozen=True)
class _Held:
    """A tensor of a layer under one of its names, as the rank that trained the layer holds it: what another
    rank needs to receive it and to put it in its own copy of the layer."""

    name: str  # in the layer
    shape: tuple[int, ...]
    dtype: str  # the owner's: the set-aside copies keep the dtype from before the precision plugin's cast
    parameter: bool
    requires_grad: bool
    persistent: bool

    def made(self, old: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
        """``value`` as this tensor: a Parameter with the owner's ``requires_grad`` (and ``old``'s attributes)."""
        if not self.parameter:
            return value
        out = like(old, value) if isinstance(old, nn.Parameter) else nn.Parameter(value)
        return out.requires_grad_(self.requires_grad)

    def install(self, layer: nn.Module, value: torch.Tensor) -> None:
        prefix, _, leaf = self.name.rpartition(".")
        module = layer.get_submodule(prefix)
        if leaf in (module._parameters if self.parameter else module._buffers):
            setattr(module, leaf, value)
            return
        if hasattr(module, leaf):  # the other kind here
            delattr(module, leaf)
        if self.parameter:
            module.register_parameter(leaf, cast(nn.Parameter, value))
        else:
            module.register_buffer(leaf, value, persistent=self.persistent)


@dataclass(frozen=True)
class _GatherPlan:
    """What every rank of the pipeline agrees on before ``gather_full_model``'s broadcasts: each layer's tensors
    as its owner holds them (``held[rank][layer]``), their order (``order``: layer by layer, the owner's names),
    and per owner the entries that are an earlier entry's tensor (``ties[rank]``: position -> position)."""

    local: list[dict[str, torch.Tensor]]  # this rank's copy of each layer: name -> tensor
    held: list[dict[int, list[_Held]]]
    order: list[tuple[int, _Held]]
    ties: list[dict[int, int]]

    @classmethod
    def agree(cls, layers: list[nn.Module], owner: dict[int, int], rank: int, group: Any) -> _GatherPlan:
        local = [dict(_named_tensors(layer)) for layer in layers]
        held: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(held, {i: _held(layer) for i, layer in enumerate(layers) if owner[i] == rank}, group)
        order = [(i, h) for i in range(len(layers)) for h in held[owner[i]][i]]
        # ties among this rank's own layers only: its copies of other ranks' layers are as the cut left them (a
        # table shared then and replaced by its owner in training is no longer that owner's)
        first: dict[int, int] = {}
        ties: dict[int, int] = {}
        for k, (i, h) in enumerate(order):
            if owner[i] != rank:
                continue
            t = id(local[i][h.name])
            if t in first:
                ties[k] = first[t]
            else:
                first[t] = k
        missing = [
            f"{layers[i].__class__.__name__} (layer {i}, trained on pipeline rank {owner[i]}) holds {h.name}, in a "
            f"submodule its copy here lacks"
            for i, h in order
            if owner[i] != rank and h.name not in local[i] and not _resolves(layers[i], h.name)
        ]
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, (ties, missing), group)
        wrong = next((m for _, ms in every for m in ms), None)
        if wrong is not None:  # every rank raises it, before any broadcast
            raise RuntimeError(
                f"gather_full_model=True cannot rebuild the trained model on every rank: {wrong} (a module made in "
                f"a forward during training). Leave gather_full_model off and read the weights from a checkpoint "
                f"(twobp-consolidate), or build that submodule in the layer's __init__"
            )
        return cls(local, held, order, [t for t, _ in every])


def _resolves(layer: nn.Module, name: str) -> bool:
    try:
        layer.get_submodule(name.rpartition(".")[0])
    except AttributeError:
        return False
    return True


def _named_tensors(layer: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every name of the layer's parameters, then of its buffers: a tensor under two names twice (a tie)."""
    yield from layer.named_parameters(remove_duplicate=False)
    yield from layer.named_buffers(remove_duplicate=False)


def _held(layer: nn.Module) -> list[_Held]:
    out = []
    for name, t in _named_tensors(layer):
        prefix, _, leaf = name.rpartition(".")
        persistent = leaf not in layer.get_submodule(prefix)._non_persistent_buffers_set
        parameter = isinstance(t, nn.Parameter)
        out.append(_Held(name, tuple(t.shape), str(t.dtype), parameter, t.requires_grad, persistent))
    return out


@contextmanager
def meta_layers_aside(model: nn.Module) -> Iterator[None]:
    """Inside, the layers an earlier Trainer call left on the meta device are out of ``model`` (an empty
    module in each one's place). Lightning's teardown moves the whole model to the CPU, which a meta
    tensor cannot do ("Cannot copy out of meta tensor"): when a call fails before setup (Lightning's own
    configuration check, say), that error would replace the real one. The layers come back after."""
    aside: list[tuple[nn.Module, str, nn.Module]] = []

    def visit(parent: nn.Module) -> None:
        for name, child in list(parent.named_children()):
            every = [t for m in child.modules() for t in _own_tensors(m)]
            if not any(t.is_meta for t in every):
                continue
            if any(t.is_meta for t in _own_tensors(child)) or all(t.is_meta for t in every):
                aside.append((parent, name, child))
                setattr(parent, name, nn.Module())
            else:
                visit(child)

    visit(model)
    try:
        yield
    finally:
        for parent, name, child in reversed(aside):
            setattr(parent, name, child)


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    """A module's own parameters and buffers, and a torchmetrics Metric's state defaults (which its
    ``_apply`` moves too; one built on the meta device is refused at setup, and must not hide why)."""
    defaults = getattr(module, "_defaults", None)
    states = [v for v in defaults.values() if isinstance(v, torch.Tensor)] if isinstance(defaults, dict) else []
    return [*module.parameters(recurse=False), *module.buffers(recurse=False), *states]


def _bounds(sizes: list[int]) -> list[int]:
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    return bounds


def named_own(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's own parameters and buffers by every name (one tensor registered twice, twice)."""
    return {n: t for d in (module._parameters, module._buffers) for n, t in d.items() if t is not None}


def like(t: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new`` in ``t``'s place: a Parameter if ``t`` is one, with ``t``'s ``requires_grad`` and the
    attributes set on it (a flag read by ``configure_optimizers``, as Mamba's ``_no_weight_decay``)."""
    out = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
    out.__dict__.update(t.__dict__)  # Python attributes only: torch keeps a tensor's hooks in C++
    return out


def replace_tensors(layers: list[nn.Module], make: Any, which: Any) -> None:
    """Replace the parameters and buffers of ``layers`` for which ``which(t)`` holds by ``make(t)``
    (a new Parameter for a parameter). A tensor used several times, in one layer or in several, is
    replaced by one new tensor: ties stay tied (one tensor under two names of a module too)."""
    made: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for layer in layers:
            for module in layer.modules():
                for name, t in named_own(module).items():
                    if id(t) not in made:
                        if not which(t):
                            continue
                        made[id(t)] = like(t, make(t))
                    setattr(module, name, made[id(t)])


def _to_meta(layers: list[nn.Module], keep: set[int]) -> None:
    """Free the tensors of ``layers``, keeping their structure (shapes, dtypes) on the meta device.
    Tensors in ``keep`` (shared with a layer this rank trains) are left alone."""
    replace_tensors(layers, lambda t: torch.empty_like(t, device="meta"), lambda t: id(t) not in keep and not t.is_meta)


def _check_parameters(layers: list[nn.Module], bounds: list[int], schedule: Schedule) -> None:
    # Checked on every rank (each knows the whole cut), so every rank stops, not only the empty one. Frozen
    # parameters count: a rank whose layers are all frozen (fine-tuning the later half of a model) trains
    # as one process does when the optimizer takes self.parameters(); an optimizer that leaves frozen
    # parameters out is empty there, which checks.checked_optimizers refuses on every rank, naming the fix.
    for r in range(schedule.num_ranks):
        stages = schedule.stages_of(r)
        if not any(True for s in stages for i in range(bounds[s], bounds[s + 1]) for _ in layers[i].parameters()):
            here = ", ".join(f"stage {s}: layers {bounds[s]}-{bounds[s + 1] - 1}" for s in stages)
            raise ValueError(
                f"pipeline rank {r} would hold no parameters ({here}), so configure_optimizers "
                f"would get an empty parameter list: give it a layer with parameters with balance=[...] "
                f"(layers per stage now {[bounds[k + 1] - bounds[k] for k in range(len(bounds) - 1)]}), "
                f"or use fewer pipeline ranks"
            )


def _check_materialized(layers: list[nn.Module], bounds: list[int], mine: Iterable[int], contract: Contract) -> None:
    for s in mine:
        for i in range(bounds[s], bounds[s + 1]):
            if any(t.is_meta for t in _tensors(layers[i])):
                raise ValueError(
                    f"{contract.describe(i)} (stage {s}, this rank's) has no weights here: a previous "
                    f"Trainer call with another pipeline layout left it on the meta device. {_HOW_TO_GET_WEIGHTS}"
                )


def _shared_parameters(
    contract: Contract, layers: list[nn.Module], layer_rank: list[int], mine: set[int]
) -> list[SharedParameter]:
    uses: dict[int, tuple[nn.Parameter, list[str], set[int], bool]] = {}
    for i, layer in enumerate(layers):
        for n, q in layer.named_parameters(remove_duplicate=False):
            _, names, ranks, here = uses.setdefault(id(q), (q, [], set(), False))
            names.append(contract.parameter_name(i, n))
            ranks.add(layer_rank[i])
            uses[id(q)] = (q, names, ranks, here or layer_rank[i] in mine)
    return [
        SharedParameter(tuple(names), tuple(sorted(ranks)), q if here else None)
        for q, names, ranks, here in uses.values()
        if len(ranks) > 1
    ]


def split_model(contract: Contract, sizes: list[int], schedule: Schedule, pp_rank: int) -> LocalModel:
    """Keep ``pp_rank``'s stages of ``contract`` and set the other layers aside (see the module
    docstring). Raises ``ValueError`` before any change when a rank would train nothing."""
    layers = contract.layers()
    bounds = _bounds(sizes)
    _check_parameters(layers, bounds, schedule)
    mine = set(schedule.stages_of(pp_rank))
    _check_materialized(layers, bounds, mine, contract)
    layer_stage = [s for s in range(len(sizes)) for _ in range(sizes[s])]
    layer_rank = [schedule.stage_to_rank[s] for s in layer_stage]
    local_ids = {id(t) for i, layer in enumerate(layers) if layer_stage[i] in mine for t in _tensors(layer)}
    stages = {s: contract.stage_module(bounds[s], bounds[s + 1], bounds) for s in sorted(mine)}
    removed = {i: layer for i, layer in enumerate(layers) if layer_stage[i] not in mine}
    shared = _shared_parameters(contract, layers, layer_rank, {pp_rank})
    _unguard(contract, removed.values())
    devices = {i: _device_of(layer) for i, layer in removed.items()}
    _to_meta(list(removed.values()), local_ids)
    hint = _ONE_CALL if isinstance(contract, SequentialContract) else ""
    current = {id(q): q for layer in removed.values() for q in layer.parameters() if not q.is_meta}
    placeholders = {
        i: _Remote(layer_stage[i], layer_rank[i], contract.parts(layer), devices[i], contract.describe(i), hint)
        for i, layer in removed.items()
    }
    for remote in placeholders.values():
        remote.__dict__["_current"] = current
    contract.swap(placeholders)
    return LocalModel(contract, list(sizes), stages, removed, dict(enumerate(layer_rank)), shared, current)
