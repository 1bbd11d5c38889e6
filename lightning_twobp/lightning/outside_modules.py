"""The modules with parameters outside a ModuleList's blocks (embeddings, final norm, head): which side of the loop
each is on, and so which stage holds it (the first or the last), and why, for the messages that name it.

Registration order first (:func:`registered_sides`: a module registered before the ModuleList runs before the
loop), then, where a trace of the model's forward before the cut says otherwise, the call order
(:meth:`OutsideModules.place_by_calls`, :mod:`.call_order`). A mixin of
:class:`~.modulelist_contract.ModuleListContract`, which provides ``list_name`` and regroups its layers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

__all__ = ["LooseParameter", "OutsideModules", "registered_sides"]


class LooseParameter(nn.Module):
    """A parameter a module on the path to the blocks holds directly (timm's ViT: ``cls_token`` and ``pos_embed``;
    Wav2Vec2's ``masked_spec_embed``; PixArt's ``scale_shift_table``), as a part of the layer that uses it (the first
    or the last, as the call-order trace finds), so the partition, the optimizer, data-parallel gradients and
    checkpoints see it as that layer's, named as one process names it (``model.cls_token``, the part's path).

    Its one parameter is its holder's entry (:class:`_HolderEntry`): whatever replaces it, through the holder (a
    model made on the meta device) or through this part (FSDP2's sharded and gathered weights, a set-aside layer
    moved to meta), both see it, as the model's forward reads it from the holder. A rank that sets the layer aside
    takes it out of the holder, keeps it here, and leaves an Elsewhere for the forward to read (:meth:`set_aside`),
    as a placeholder does for a module; :meth:`put_back` returns it."""

    def __init__(self, holder: nn.Module, name: str) -> None:
        super().__init__()
        self.__dict__.update(_holder=holder, _name=name, _parameters=_HolderEntry(holder, name))

    def tensor(self) -> torch.Tensor:
        q = self._parameters[self.__dict__["_name"]]
        assert q is not None  # found by named_parameters, which skips None
        return q

    def set_aside(self, stand_in: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Take the parameter out of its holder; ``stand_in(tensor)`` makes what a read of it gives."""
        self.__dict__["_stand_in"] = stand_in
        self._entry().detach()
        self.refresh()

    def refresh(self) -> None:
        """Make the stand-in again (the model moved or was cast since), while set aside."""
        stand_in = self.__dict__.get("_stand_in")
        if stand_in is not None:  # found before nn.Module.__getattr__ looks for a parameter
            self.__dict__["_holder"].__dict__[self.__dict__["_name"]] = stand_in(self.tensor())

    def put_back(self) -> None:
        self.__dict__.pop("_stand_in", None)
        self.__dict__["_holder"].__dict__.pop(self.__dict__["_name"], None)
        self._entry().attach()

    def _entry(self) -> _HolderEntry:
        entry = self.__dict__["_parameters"]
        assert isinstance(entry, _HolderEntry)
        return entry

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a parameter a module holds directly is read by that module's forward, not called")


class _HolderEntry(MutableMapping):
    """A :class:`LooseParameter`'s ``_parameters``: one name, read from and written into its holder's own
    ``_parameters`` while attached; kept here while detached (the layer set aside, the holder reading a stand-in)."""

    def __init__(self, holder: nn.Module, name: str) -> None:
        self.holder, self.name = holder, name
        self.kept: Any = _ATTACHED

    def detach(self) -> None:
        if self.kept is _ATTACHED:
            self.kept = self.holder._parameters.pop(self.name)

    def attach(self) -> None:
        if self.kept is not _ATTACHED:
            self.holder._parameters[self.name], self.kept = self.kept, _ATTACHED

    def __getitem__(self, key: str) -> Any:
        if key != self.name:
            raise KeyError(key)
        return self.holder._parameters[key] if self.kept is _ATTACHED else self.kept

    def __setitem__(self, key: str, value: Any) -> None:
        if key != self.name:
            raise KeyError(f"a LooseParameter holds {self.name!r} only, not {key!r}")
        if self.kept is _ATTACHED:
            self.holder._parameters[key] = value
        else:
            self.kept = value

    def __delitem__(self, key: str) -> None:
        raise TypeError(f"{self.name!r} is its holder's parameter: delete it there")

    def __iter__(self) -> Iterator[str]:
        return iter((self.name,))

    def __len__(self) -> int:
        return 1


_ATTACHED = object()


class OutsideModules:
    """Where each outside module is, and why (see the module docstring)."""

    list_name: str

    def __init__(self, outside: list[tuple[str, nn.Module]], before: set[str]) -> None:
        self._outside = outside  # (path, module), in registration order
        self._before = before  # the paths on the first stage; the others are on the last
        self.placed_why: str | None = "no trace was run"  # why registration order placed them (None: call order)
        self._sides: dict[str, str] = {}  # the trace's: "before", "after", "both" or "inside"

    def _regroup(self) -> None:
        """Rebuild the layers after a move (the contract's)."""
        raise NotImplementedError

    def outside(self) -> list[tuple[str, nn.Module]]:
        """The modules with parameters outside the blocks, in registration order."""
        return list(self._outside)

    def place_by_calls(self, sides: Mapping[str, str], why: str | None) -> list[str]:
        """Put each module outside the blocks on the side of the loop the model's forward calls it (``sides[path]``:
        ``"before"`` or ``"after"``, traced before the cut by :mod:`.call_order`); the others stay where
        registration order put them, ``why`` the reason when none was traced. Returns the modules that moved.
        Before the partition: the layers are its units."""
        placed = {p: side for p, side in sides.items() if side in ("before", "after")}
        moved = [p for p, _ in self._outside if p in placed and (placed[p] == "before") != (p in self._before)]
        self._before ^= set(moved)
        self._sides, self.placed_why = dict(sides), why
        self._regroup()
        self._refuse_unplaced_loose()
        return moved

    def _refuse_unplaced_loose(self) -> None:
        """A module the trace did not place keeps its registration place; a parameter held directly has none
        (registration order says nothing of where the forward uses it). One traced on both sides of the loop or
        between the blocks is refused, on every rank, before any compute; one the trace could not see goes before the
        blocks, where such parameters mostly are, and is said; one the traced forward never used stays, unused."""
        for path, part in self._outside:
            side = self._sides.get(path)
            if not isinstance(part, LooseParameter) or side in ("before", "after"):
                continue
            if side is None and self.placed_why is None:
                continue
            if side is None:  # not traced: before the blocks, where such parameters mostly are, and said
                rank_zero_warn(self._loose_unplaced(path, part, side))
                continue
            raise ValueError(self._loose_unplaced(path, part, side))

    def _loose_unplaced(self, path: str, part: LooseParameter, side: str | None) -> str:
        holder = path.rpartition(".")[0] or "the LightningModule"
        what = f"{path} (shape {tuple(part.tensor().shape)}), a parameter held directly by {holder}"
        if side is None:
            return (
                f"twobp: {what} beside the blocks in {self.list_name}, is placed on the first pipeline stage: the "
                f"call order, which says which side of the loop uses it, was not traced ({self.placed_why}). If the "
                f"model's forward uses it after the blocks, the first step fails on the last stage; then put it in a "
                f"module of its own registered after the blocks (one registered before them goes to the first stage)"
            )
        if side == "both":
            return (
                f"the model's forward uses {what}, both before and after {self.list_name} (traced on the meta device "
                f"before the cut): no one pipeline stage holds it. Give each side a module of its own holding it, tied "
                f"(`self.pre, self.post = nn.Module(), nn.Module(); self.pre.w = self.post.w = w`, each side reading "
                f"its own): a parameter of modules on two stages is kept in sync, as tied embeddings are"
            )
        return (
            f"the model's forward uses {what}, between the blocks of {self.list_name} (given to them, or computed with "
            f"between two of them; traced on the meta device before the cut): the blocks sit on several pipeline "
            f"stages, and no one stage holds it. Make it the blocks' own (each block a parameter of its own, or one "
            f"holding it and the others tied to it, `block.w = first.w`: a parameter of modules on several stages is "
            f"kept in sync, as tied embeddings are), or use it before or after the loop only"
        )

    def on_first_stage(self, path: str) -> bool:
        """Whether ``path`` is placed on the first pipeline stage (else on the last)."""
        return path in self._before

    def _traced(self, path: str) -> bool:
        """Whether the call-order trace placed ``path``."""
        return self._sides.get(path) in ("before", "after")

    def placed(self, path: str, before: bool) -> str:
        """Why ``path`` is on the stage it is: the traced call order, or registration order and why."""
        side, stage = ("before", "first") if before else ("after", "last")
        if self._traced(path):
            return (
                f"the model's forward called it {side} {self.list_name} when traced on the meta device before the cut, "
                f"so it was placed on the {stage} pipeline stage"
            )
        return (
            f"it is registered {side} {self.list_name}, so it was placed on the {stage} pipeline stage (under "
            f"strategy='twobp' the modules with parameters outside the blocks go where the model's forward calls them; "
            f"{self._untraced(path)}, so by registration order: before the blocks to the first stage, after them to "
            f"the last)"
        )

    def _untraced(self, path: str) -> str:
        """Why the trace did not place ``path``."""
        if self.placed_why is not None:
            return f"the call order was not traced before the cut ({self.placed_why})"
        traced = self._sides.get(path)
        if traced == "both":
            return "the traced forward called it both before and after the loop"
        if traced == "inside":
            return "the traced forward called it between the blocks"
        return "the traced forward of the model did not call it: the step calls it, or the model on some batches only"

    def misplaced_fix(self, path: str, before: bool) -> str:
        """The fix for ``path``, placed on the side of the loop it is not called on."""
        if self._traced(path):
            return (
                "make the model's forward call it on one side of the loop whatever the batch (the side it was traced "
                "on must not depend on the data or the mode), or pass TwoBPStrategy(placement='registration') and "
                "register it on the side it runs"
            )
        if self._sides.get(path) == "inside" and self.placed_why is None:
            return (
                "make it part of a block, or call it before or after the loop: a module with parameters between the "
                "blocks has no stage of its own"
            )
        if self._sides.get(path) == "both" and self.placed_why is None:
            return (
                "give each side of the loop a module of its own (a module with parameters is on one pipeline stage: "
                "the first or the last), or, if it runs on one side only in training, register it on that side"
            )
        if before:
            return (
                f"make the registration order follow the call order: re-register it after the blocks before the "
                f"Trainer call (`m = self.{path}; del self.{path}; self.{path} = m` moves it last in its parent's "
                f"registration order)"
            )
        return (
            f"make the registration order follow the call order: re-register {self.holding_blocks(path)} and the "
            f"modules registered after it that run after the loop (a `del` then a setattr moves a module last in its "
            f"parent's registration order)"
        )

    def registration_hint(self, path: str, before: bool) -> str:
        """Why a module outside the blocks is on the stage it is, and the fix where a step calls it on the other side
        of the blocks (a head registered before the blocks on the LightningModule)."""
        other = "after" if before else "before"
        if self._traced(path):
            fix = f"; if the step calls it {other} the blocks, pass TwoBPStrategy(placement='registration')"
        elif self.placed_why is None and path not in self._sides:  # traced: the model's forward never called it
            # the step's own call: its code before the pipelined call runs on the first stage (for the inputs) and
            # again on the last (for the loss), so re-registering only moves the refusal to the other stage
            fix = (
                f"; the step calls it: if before the pipelined call (a teacher whose output the loss takes), call it "
                f"after, where only the last stage runs the step's code, and keep it registered after the blocks (the "
                f"step's code before that call runs on the first stage and again on the last, and a module with "
                f"parameters is on one of them); if it runs {other} the blocks, register it {other} them"
            )
        else:
            fix = f"; if it runs {other} the blocks, register it {other} them"
        return (
            f"; {self.placed(path, before)}{fix} (a `del` then a setattr moves a module last in its parent's "
            f"registration order)"
        )

    def holding_blocks(self, path: str) -> str:
        """The module beside ``path`` (a child of the same parent) that holds the blocks: what moves after it in
        that parent's registration order (the blocks themselves, or a tower around them: CLIP's text_model when
        its vision_model, registered after it, runs first)."""
        parent = path.rpartition(".")[0]
        inside = self.list_name[len(parent) + 1 :] if parent else self.list_name
        return f"{parent}.{inside.split('.')[0]}" if parent else inside.split(".")[0]


def registered_sides(
    root: nn.Module, blocks: nn.ModuleList | nn.Sequential, name: str, ancestors: set[int]
) -> tuple[list, list]:
    """The modules with parameters outside the blocks, as ``(pre, post)`` lists of ``(path, module)``:
    registered before the ModuleList (in module-tree order) they run before the loop, after it
    after. A parameter held directly by a module on the path to the ModuleList is a :class:`LooseParameter` part,
    before the loop until the call-order trace says otherwise."""
    pre: list[tuple[str, nn.Module]] = []
    post: list[tuple[str, nn.Module]] = []
    _walk(root, "", blocks, name, ancestors, {id(m) for m in blocks.modules()}, [pre, post], len(ancestors) == 1)
    return pre, post


def _walk(
    module: nn.Module,
    prefix: str,
    blocks: nn.Module,
    name: str,
    ancestors: set[int],
    seen: set[int],
    sides: list,
    called: bool = True,
) -> None:
    """``module``'s children into ``sides[-1]`` in registration order (``sides``: ``[pre, post]``; the ModuleList
    pops ``pre``), descending into the ModuleList's ancestors. ``called``: ``module`` is (inside) the module the step
    calls, whose forward the call-order trace runs: the LightningModule is only where its own forward loops."""
    sides[0].extend((prefix + n, _loose_part(module, n)) for n in _loose(module, prefix, name, called))
    for attr, child in module._modules.items():
        if child is blocks:
            if len(sides) == 2:
                sides.pop(0)
            continue
        if child is None or id(child) in seen:
            continue
        path = prefix + attr
        if id(child) in ancestors:
            _walk(child, path + ".", blocks, name, ancestors, seen, sides)  # the module the step calls, or inside it
            continue
        seen.update(id(m) for m in child.modules())
        if next(child.parameters(), None) is not None:
            sides[0].append((path, child))


def _loose_part(holder: nn.Module, name: str) -> LooseParameter:
    """The one part of ``holder``'s parameter ``name`` for every Trainer call's contract, kept on the holder: a call
    that set it aside leaves it on meta, guarded by the part (local_model's ``left_on_meta``), and a part made anew
    each call let the earlier one, and its guard, be collected: the next call took that meta tensor for one the
    user built on meta."""
    parts = holder.__dict__.setdefault("_twobp_loose_parts", {})
    if name not in parts:
        parts[name] = LooseParameter(holder, name)
    return parts[name]


def _loose(module: nn.Module, prefix: str, name: str, called: bool) -> list[str]:
    """The names of the parameters ``module`` (on the path to the ModuleList) holds directly; refused where no stage
    could compute with them, or where the step's own code around the model's call uses them (``called`` False)."""
    loose = [n for n, _ in module.named_parameters(recurse=False)]
    if not loose:
        return loose
    where = prefix[:-1] or f"the {type(module).__name__} itself"
    if getattr(getattr(module, "config", None), "use_weighted_layer_sum", False) is True:
        # Hugging Face's audio classifiers: a weighted sum of every block's hidden states, which no
        # module of one stage can compute; moving the weights into a module would not help
        raise ValueError(
            f"{where} mixes the hidden states of every block in {name} (use_weighted_layer_sum=True in "
            f"{where}.config, weighted by its parameter {', '.join(loose)}): under strategy='twobp' each "
            f"pipeline stage holds only its own blocks' hidden states, so that sum cannot be computed; set "
            f"use_weighted_layer_sum=False in the config before building the model (the classifier then "
            f"reads the last block's output)"
        )
    if not called:  # the step's code before the model's call runs on every stage, the loss after it on the last
        raise ValueError(
            f"{where} holds parameters directly ({', '.join(loose)}) beside the model that holds the blocks in "
            f"{name}: under strategy='twobp' the step's code before the model's call runs on every pipeline stage and "
            f"the code after it on the last, so no one stage can hold them; put them in a module of their own "
            f"registered after the model (the last stage, where the loss is computed), or inside the model, whose "
            f"forward may use them as one process does"
        )
    return loose
