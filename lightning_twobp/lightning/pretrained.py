"""Pretrained weights read stage by stage: ``TwoBPStrategy(pretrained=directory)``.

A model too large for one device is built on the meta device (:mod:`.materialize`) and fine-tuned from a
checkpoint no rank could hold whole. Each rank reads only the tensors it holds (its stages' layers and
what lies outside the pipelined layers), through ``torch.distributed.checkpoint``: Hugging Face
safetensors (``save_pretrained``'s directory, a Hub snapshot, sharded or not) with its
``HuggingFaceStorageReader``, or a checkpoint directory of this strategy's own (its weights only).

* :func:`plan`, at setup before any compute and alike on every rank (from the file's header and the
  model's structure, which every rank has whole, on meta or not): which module the file's names are
  under (``pretrained_prefix``, else found: the module path under which the most of the file's names
  are the model's), every shape checked, what the file lacks and what it holds beyond the model.
* :func:`load`, after this rank's stages are known and before any data-parallel sharding: this rank's
  tensors read in place, cast to the model's dtypes (as ``load_state_dict`` copies).

Read once per model, at the first Trainer call that sets it up (:func:`mark_read`): a later call (validate
after fit) keeps the model's weights. A call resuming from ``ckpt_path`` reads nothing (the checkpoint
writes every weight).
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

__all__ = ["Plan", "load", "mark_read", "plan", "read_before", "warn_unmatched"]

log = logging.getLogger(__name__)

# this strategy's checkpoints hold the model's weights under "model.", beside the optimizers' state
_OURS = "model."
_SHOWN = 5  # names shown in a message before "and N more"

# the models whose weights were read (or written by a resumed checkpoint): a later call leaves them be
_READ: weakref.WeakSet[nn.Module] = weakref.WeakSet()


@dataclass(frozen=True)
class Plan:
    """What :func:`load` reads: ``keys`` maps each of the model's state-dict names to the file's key (the
    names of one tensor, a tied weight, to the same key)."""

    path: Path
    ours: bool  # this strategy's checkpoint (else Hugging Face safetensors)
    prefix: str  # the module path the file's names are under, "" or ending in "."
    keys: dict[str, str]
    missing: tuple[str, ...]  # the model's tensors the file lacks: left as initialized
    unused: tuple[str, ...]  # the file's tensors that are no tensor of the model


def _reader(path: Path) -> tuple[Any, dict[str, tuple[int, ...]], bool]:
    """The storage reader of ``path``, the shape of every tensor it holds by the model-side name, and
    whether it is this strategy's checkpoint."""
    if (path / ".metadata").is_file():
        reader: Any = dcp.FileSystemReader(path)
        saved = reader.read_metadata().state_dict_metadata
        shapes = {
            k[len(_OURS) :]: tuple(m.size) for k, m in saved.items() if k.startswith(_OURS) and hasattr(m, "size")
        }
        return reader, shapes, True
    try:
        import safetensors  # noqa: F401 - the reader imports it inside; named here, before any read
    except ImportError as err:
        raise ImportError(
            f"TwoBPStrategy(pretrained={str(path)!r}) reads safetensors: pip install safetensors"
        ) from err
    reader = dcp.HuggingFaceStorageReader(str(path))
    saved = reader.read_metadata().state_dict_metadata
    return reader, {k: tuple(m.size) for k, m in saved.items()}, False


def _shown(names: Iterable[str]) -> str:
    names = list(names)
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def _find_prefix(files: set[str], model: dict[str, Any], given: str | None) -> str:
    """The module path the file's names are under: ``given``, else the one under which the most of them
    are names of the model (refused where none or several are best)."""
    if given is not None:
        return given.rstrip(".") + "." if given.strip(".") else ""
    modules = {name.rsplit(".", 1)[0] + "." for name in model if "." in name}
    paths = {""} | {m[: i + 1] for m in modules for i, c in enumerate(m) if c == "."}
    score = {p: sum(p + k in model for k in files) for p in paths}
    best = max(score.values())
    winners = sorted(p for p, s in score.items() if s == best)
    if best == 0:
        raise ValueError(
            f"none of the pretrained file's {len(files)} tensor names ({_shown(sorted(files))}) is a name of the "
            f"model's tensors ({_shown(sorted(model))}) under any module: pass "
            f"TwoBPStrategy(pretrained_prefix='<module>') naming the module the weights are for, or save the "
            f"weights from the same model class"
        )
    if len(winners) > 1:
        raise ValueError(
            f"the pretrained weights match {best} tensors under each of the modules "
            f"{', '.join(repr(w.rstrip('.')) for w in winners)}: pass TwoBPStrategy(pretrained_prefix=...) "
            f"naming the one they are for"
        )
    return winners[0]


def _tensors(module: nn.Module) -> dict[str, Any]:
    """The model's state-dict tensors by every name (on meta or not, as built)."""
    return dict(module.state_dict(keep_vars=True))


def plan(path: str | Path, module: nn.Module, prefix: str | None = None) -> Plan:
    """Which file tensor goes to which of the model's tensors, every shape checked: ValueError before any
    read, alike on every rank."""
    path = Path(path)
    reader, shapes, ours = _reader(path)
    model = _tensors(module)
    prefix = _find_prefix(set(shapes), model, prefix)
    if prefix and not any(name.startswith(prefix) for name in model):
        raise ValueError(
            f"TwoBPStrategy(pretrained_prefix={prefix.rstrip('.')!r}): the model has no tensor under that "
            f"module; name the module the weights are for ('' for the LightningModule itself)"
        )
    keys: dict[str, str] = {}
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in model.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    missing = []
    for names in by_tensor.values():  # a tensor is read through the first of its names the file has
        found = [n for n in names if n.startswith(prefix) and n[len(prefix) :] in shapes]
        if found:  # every name: a rank may hold the tensor under another (a tied weight's stage)
            keys.update(dict.fromkeys(names, (_OURS if ours else "") + found[0][len(prefix) :]))
        else:
            missing.extend(names)
    _check_shapes(path, keys, model, shapes, prefix, ours)
    used = {k[len(_OURS) :] if ours else k for k in keys.values()}  # the file's names read
    aliases = {n[len(prefix) :] for n in model if n.startswith(prefix)}
    unused = tuple(sorted(k for k in shapes if k not in used and k not in aliases))
    return Plan(path, ours, prefix, keys, tuple(sorted(missing)), unused)


def _check_shapes(
    path: Path, keys: dict[str, str], model: dict[str, Any], shapes: dict[str, tuple[int, ...]], prefix: str, ours: bool
) -> None:
    wrong = []
    for name, key in keys.items():
        saved = shapes[key[len(_OURS) :] if ours else key]
        if tuple(model[name].shape) != saved:
            wrong.append(f"{name}: {tuple(model[name].shape)} in the model, {saved} in the file")
    if wrong:
        raise ValueError(
            f"the pretrained weights in {path} do not fit the model: {len(wrong)} tensor(s) differ in shape: "
            f"{_shown(wrong)}. Build the model with the config the weights were saved with"
        )


def warn_unmatched(p: Plan) -> None:
    """What the file lacks and what it holds beyond the model, once (as Hugging Face's loading says it)."""
    if p.missing:
        rank_zero_warn(
            f"twobp: {len(p.missing)} tensor(s) of the model are not in the pretrained weights {p.path} and keep "
            f"the values the model was built with: {_shown(p.missing)}"
        )
    if p.unused:
        rank_zero_warn(
            f"twobp: {len(p.unused)} tensor(s) in {p.path} are not the model's and are not read: {_shown(p.unused)}"
        )


def read_before(module: nn.Module) -> bool:
    """Whether the model's weights were read already (or set by a resumed checkpoint) in an earlier call."""
    return module in _READ


def mark_read(module: nn.Module) -> None:
    """The model holds its weights from now on: later Trainer calls leave them be."""
    _READ.add(module)


def load(p: Plan, module: nn.Module) -> int:
    """Read into ``module`` the planned tensors it holds now (this rank's stages and what lies outside
    them; other ranks' layers are set aside or on meta), in place; the number read."""
    state: dict[str, torch.Tensor] = {}
    copies: list[tuple[torch.Tensor, str]] = []  # a second tensor of one key here (a tied weight's copy)
    for name, tensor in _tensors(module).items():
        if name not in p.keys or tensor.is_meta:
            continue
        key = p.keys[name]
        if key not in state:
            state[key] = tensor.detach()
        elif state[key] is not tensor and state[key].data_ptr() != tensor.data_ptr():
            copies.append((tensor, key))
    if state:
        reader = dcp.FileSystemReader(p.path) if p.ours else dcp.HuggingFaceStorageReader(str(p.path))
        with torch.no_grad(), warnings.catch_warnings():
            # each rank reads on its own (no_dist), and torch says it assumes one process: that is the intent
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
            for tensor, key in copies:
                tensor.copy_(state[key])
    return len(state)
