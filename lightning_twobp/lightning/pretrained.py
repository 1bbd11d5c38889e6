"""Pretrained weights read stage by stage: ``TwoBPStrategy(pretrained=directory)``.

A model too large for one device is built on the meta device (:mod:`.materialize`) and fine-tuned from a
checkpoint no rank could hold whole. Each rank reads only the tensors it holds (its stages' layers and
what lies outside the pipelined layers), through ``torch.distributed.checkpoint``: Hugging Face
safetensors (``save_pretrained``'s directory, a Hub snapshot, sharded or not) with its
``HuggingFaceStorageReader``, or a checkpoint directory of this strategy's own (its weights only).

* :func:`plan`, at setup before any compute and alike on every rank (from the files' headers and the
  model's structure, which every rank has whole, on meta or not): which module the file's names are
  under (``pretrained_prefix``, else found: the module path under which the most of the file's names
  are the model's, a leading part of the file's names dropped where that fits more, as a causal LM's
  ``model.`` for its base model), every shape checked, what the file lacks and what it holds beyond
  the model. Refused: a key in two files of the directory (two saves in one folder), a file whose
  header cannot be read, names that fit nowhere or two places alike, and a Hugging Face model whose
  weights transformers renames or fuses when loading (its MoE experts) where the file would leave
  tensors unset.
* :func:`load`, after this rank's stages are known and before any data-parallel sharding: this rank's
  tensors read in place, cast to the model's dtypes (as ``load_state_dict`` copies).

Read once per model object, at the first Trainer call that sets it up (:func:`mark_read`): a later call
(validate after fit) keeps the model's weights, and so does a call after one that loaded a checkpoint
(``ckpt_path``, which Lightning loads after setup, over the weights read there).
"""

from __future__ import annotations

import logging
import sys
import warnings
import weakref
from collections import Counter, defaultdict
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
_META = "meta.pt"  # lightning.checkpoint.META: what tells this strategy's checkpoint from another DCP one
_SHOWN = 5  # names shown in a message before "and N more"

# the models whose weights were read (or written by a resumed checkpoint): a later call leaves them be
_READ: weakref.WeakSet[nn.Module] = weakref.WeakSet()


@dataclass(frozen=True)
class Plan:
    """What :func:`load` reads: ``keys`` maps each of the model's state-dict names to the file's key (the
    names of one tensor, a tied weight, to the same key)."""

    path: Path
    kind: str  # "safetensors", "ours" (this strategy's checkpoint) or "dcp" (another torch.distributed.checkpoint)
    prefix: str  # the module path the file's names are under, "" or ending in "."
    keys: dict[str, str]
    missing: tuple[str, ...]  # the model's tensors the file lacks: left as initialized
    unused: tuple[str, ...]  # the file's tensors that are no tensor of the model


def _safetensors_files(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the directory's safetensors, each file's header read (refused where a key is
    in two files: the reader would take either, tensor by tensor)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, list[str]] = defaultdict(list)
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - a safetensors handle, not a mapping
                    shapes[key] = tuple(f.get_slice(key).get_shape())
                    where[key].append(file.name)
        except Exception as err:  # noqa: BLE001 - named with the file and the likely cause
            raise ValueError(
                f"pretrained: the header of {file} cannot be read ({type(err).__name__}: {err}); a file of a few "
                f"hundred bytes is a Git LFS pointer (git lfs pull fetches the weights)"
            ) from err
    twice = {k: files for k, files in where.items() if len(files) > 1}
    if twice:
        key, files = next(iter(twice.items()))
        raise ValueError(
            f"pretrained: {len(twice)} tensor(s) are in more than one file of {path} ({key} in {', '.join(files)}): "
            f"the folder holds two saves (save_pretrained leaves an earlier model.safetensors beside new shards). "
            f"Keep the files of one save (those model.safetensors.index.json lists) in a folder of their own"
        )
    return shapes


def _entries(path: Path) -> tuple[str, dict[str, tuple[str, tuple[int, ...]]]]:
    """What the directory holds: its kind, and by the name the model sees each tensor under, the key it is
    stored under and its shape."""
    if not (path / ".metadata").is_file():
        try:
            shapes = _safetensors_files(path)
        except ImportError as err:
            raise ImportError(f"pretrained={str(path)!r}: reading safetensors needs pip install safetensors") from err
        return "safetensors", {k: (k, shape) for k, shape in shapes.items()}
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    tensors = {k: tuple(m.size) for k, m in saved.items() if hasattr(m, "size")}
    if not (path / _META).is_file():
        return "dcp", {k: (k, shape) for k, shape in tensors.items()}
    ours = {k[len(_OURS) :]: (k, shape) for k, shape in tensors.items() if k.startswith(_OURS)}
    return "ours", ours


def _reader(p: Plan) -> Any:
    if p.kind == "safetensors":
        return dcp.HuggingFaceStorageReader(str(p.path))
    return dcp.FileSystemReader(p.path)


def _shown(names: Iterable[str]) -> str:
    names = list(names)
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def _by_suffix(model: Iterable[str]) -> dict[str, list[str]]:
    """For each trailing part of the model's names (``mlp.up.weight``), the module paths before it."""
    out: dict[str, list[str]] = defaultdict(list)
    for name in model:
        parts = name.split(".")
        for i in range(len(parts)):
            out[".".join(parts[i:])].append("".join(f"{q}." for q in parts[:i]))
    return out


def _pairings(files: set[str], model: dict[str, Any], given: str | None) -> Counter[tuple[str, str]]:
    """How many of the file's names each (module path, leading part of the file's names dropped) puts on a
    name of the model; the module path ``given`` only, where given."""
    suffixes = _by_suffix(model)
    drops = {""} | {f.split(".", 1)[0] + "." for f in files if "." in f}
    score: Counter[tuple[str, str]] = Counter()
    for drop in drops:
        for f in files:
            if f.startswith(drop):
                for path in suffixes.get(f[len(drop) :], ()):
                    if given is None or path == given:
                        score[(path, drop)] += 1
    return score


def _find_prefix(files: set[str], model: dict[str, Any], given: str | None) -> tuple[str, str]:
    """The module path the file's names go under and the leading part of them dropped: ``given``'s path,
    else the pairing that puts the most of them on the model's names, at least half of them (a bare
    ``weight`` left after dropping fits any module); refused where none does, or two that differ do."""
    if given is not None:
        given = given.strip(".") + "." if given.strip(".") else ""
    score = _pairings(files, model, given)
    best = max(score.values(), default=0)
    if best == 0 or (given is None and 2 * best < len(files)):
        under = f"under the module {given.rstrip('.')!r}" if given is not None else "under any one module"
        fix = (
            "name the module the weights are for (pretrained_prefix='' for the LightningModule itself)"
            if given
            else "pass TwoBPStrategy(pretrained_prefix='<module>') naming the module the weights are for"
        )
        raise ValueError(
            f"{f'only {best}' if best else 'none'} of the pretrained file's {len(files)} tensor names "
            f"({_shown(sorted(files))}) are names of the model's tensors ({_shown(sorted(model))}) {under}: "
            f"{fix}, or save the weights from the same model class"
        )
    winners = sorted(pair for pair, s in score.items() if s == best)
    placed = {pair: frozenset(pair[0] + f[len(pair[1]) :] for f in files if f.startswith(pair[1])) for pair in winners}
    if len(set(placed.values())) > 1:  # pairings that put the names in the same places are one
        raise ValueError(
            f"the pretrained weights match {best} tensors under each of the modules "
            f"{', '.join(repr(p.rstrip('.')) for p, _ in winners)}: pass TwoBPStrategy(pretrained_prefix=...) "
            f"naming the one they are for"
        )
    return min(winners, key=lambda pair: (len(pair[1]), pair))


def _tensors(module: nn.Module) -> dict[str, Any]:
    """The model's state-dict tensors by every name (on meta or not, as built)."""
    return dict(module.state_dict(keep_vars=True))


def plan(path: str | Path, module: nn.Module, prefix: str | None = None) -> Plan:
    """Which file tensor goes to which of the model's tensors, every shape checked: ValueError before any
    read, alike on every rank."""
    path = Path(path)
    kind, entries = _entries(path)
    model = _tensors(module)
    prefix, drop = _find_prefix(set(entries), model, prefix)
    keys: dict[str, str] = {}
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in model.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    missing = []
    for names in by_tensor.values():  # a tensor is read through the first of its names the file has
        found = [n for n in names if n.startswith(prefix) and drop + n[len(prefix) :] in entries]
        if found:  # every name: a rank may hold the tensor under another (a tied weight's stage)
            keys.update(dict.fromkeys(names, drop + found[0][len(prefix) :]))
        else:
            missing.extend(names)
    _check_shapes(path, keys, model, entries)
    _check_conversions(module, prefix, [n for n in missing if n.startswith(prefix)])
    read = set(keys.values())
    unused = tuple(sorted(k for k in entries if k not in read))
    stored = {name: entries[key][0] for name, key in keys.items()}
    return Plan(path, kind, prefix, stored, tuple(sorted(missing)), unused)


def _check_shapes(
    path: Path, keys: dict[str, str], model: dict[str, Any], entries: dict[str, tuple[str, tuple[int, ...]]]
) -> None:
    wrong = []
    for name, key in keys.items():
        saved = entries[key][1]
        if tuple(model[name].shape) != saved:
            wrong.append(f"{name}: {tuple(model[name].shape)} in the model, {saved} in the file")
    if wrong:
        raise ValueError(
            f"the pretrained weights in {path} do not fit the model: {len(wrong)} tensor(s) differ in shape: "
            f"{_shown(wrong)}. Build the model with the config the weights were saved with"
        )


def _check_conversions(module: nn.Module, prefix: str, unset: list[str]) -> None:
    """A Hugging Face model whose checkpoint names transformers converts when it loads them (Mixtral's
    experts fused into one tensor, renamed blocks): read as saved, its converted tensors would keep their
    initial values. Refused where the file leaves some of the model's tensors under ``prefix`` unset."""
    if not unset or "transformers" not in sys.modules:
        return
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping

    for name, sub in module.named_modules():  # the outermost Hugging Face model around or under the prefix
        path = f"{name}." if name else ""
        if not isinstance(sub, PreTrainedModel) or not (path.startswith(prefix) or prefix.startswith(path)):
            continue
        converts = get_model_conversion_mapping(sub, add_legacy=False)
        if converts:
            raise ValueError(
                f"transformers converts the checkpoint names of {type(sub).__name__} when it loads them "
                f"({_shown(str(c) for c in converts)}); pretrained= reads them as saved, and {len(unset)} "
                f"tensor(s) of the model would keep their initial values ({_shown(unset)}). Save the weights "
                f"under the model's own names once (safetensors.torch.save_file(model.state_dict(), ...), "
                f"from a model from_pretrained loaded), or build the model with from_pretrained on the CPU"
            )
        return


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
        reader = _reader(p)
        with torch.no_grad(), warnings.catch_warnings():
            # each rank reads on its own (no_dist), and torch says it assumes one process: that is the intent
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
            for tensor, key in copies:
                tensor.copy_(state[key])
    return len(state)
