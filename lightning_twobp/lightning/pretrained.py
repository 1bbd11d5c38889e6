"""Pretrained weights read stage by stage: ``TwoBPStrategy(pretrained=directory)``.

A model too large for one device is built on the meta device (:mod:`.materialize`) and fine-tuned from a
checkpoint no rank could hold whole. Each rank reads only the tensors it holds (its stages' layers and
what lies outside the pipelined layers), through ``torch.distributed.checkpoint``: Hugging Face
safetensors, a checkpoint directory of this strategy's own (its weights only) or another DCP directory
(:mod:`.pretrained_files` reads what a directory holds from its headers).

* :func:`plan`, at setup before any compute and alike on every rank (from the headers and the model's
  structure, which every rank has whole, on meta or not): which module the file's names are under
  (``pretrained_prefix``, else found: the module path under which the most of the file's names are the
  model's, a leading part of the file's names dropped where that fits more, as a causal LM's ``model.``
  for its base model), every shape and dtype checked, what the file lacks and what it holds beyond the
  model. Refused: names that fit nowhere or two places alike, shapes that differ, quantized tensors,
  and a file holding names transformers converts when it loads them (MoE experts, old LayerNorm names)
  where they would leave the model's tensors unset.
* :func:`load`, after this rank's stages are known and before any data-parallel sharding: this rank's
  tensors read in place, cast to the model's dtypes (as ``load_state_dict`` copies).

Read once per model object, at the first Trainer call that sets it up (:func:`mark_read`): a later call
(validate after fit) keeps the model's weights, and so does a call after one that loaded a checkpoint
(``ckpt_path``, which Lightning loads after setup, over the weights read there).
"""

from __future__ import annotations

import warnings
import weakref
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_twobp.lightning import pretrained_conversions as conversions
from lightning_twobp.lightning.pretrained_conversions import Converted
from lightning_twobp.lightning.pretrained_files import FLOATS, Source, read_headers

__all__ = ["Plan", "load", "mark_read", "plan", "read_before", "warn_unmatched"]

_SHOWN = 5  # names shown in a message before "and N more"

# the models whose weights were read (or written by a resumed checkpoint), with the directory read: a
# later call leaves them be
_READ: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Plan:
    """What :func:`load` reads: ``keys`` maps each of the model's state-dict names to the stored key (the
    names of one tensor, a tied weight, to the same key)."""

    source: Source
    prefix: str  # the module path the file's names are under, "" or ending in "."
    keys: dict[str, str]
    missing: tuple[str, ...]  # the model's tensors the file lacks: left as initialized
    unused: tuple[str, ...]  # the file's tensors that are not read
    converted: Converted = conversions.NOTHING  # the file's names transformers fuses (MoE experts)

    @property
    def path(self) -> Path:
        return self.source.path


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


def _pairings(files: set[str], model: dict[str, Any], given: str | None) -> dict[tuple[str, str], frozenset[str]]:
    """For each (module path, leading part of the file's names dropped), the file's names it puts on a name
    of the model; the module path ``given`` only, where given. A part is dropped only where a dotted name
    is left (a bare ``weight`` would fit any module)."""
    suffixes = _by_suffix(model)
    drops = {""} | {f.split(".", 1)[0] + "." for f in files if "." in f}
    placed: dict[tuple[str, str], set[str]] = defaultdict(set)
    for drop in drops:
        for f in files:
            rest = f[len(drop) :]
            if f.startswith(drop) and (not drop or "." in rest):
                for path in suffixes.get(rest, ()):
                    if given is None or path == given:
                        placed[(path, drop)].add(f)
    return {pair: frozenset(names) for pair, names in placed.items()}


class Ambiguous(ValueError):
    """The file's names fit two places alike: refused whatever else could read them."""


def _find_prefix(
    files: set[str], model: dict[str, Any], given: str | None, convertible: frozenset[str] = frozenset()
) -> tuple[str, str]:
    """The module path the file's names go under and the leading part of them dropped: ``given``'s path,
    else the pairing that puts the most of them on the model's names, found only where it places at least
    half of the names under the part it drops, counting those a conversion of the model's Hugging Face
    models takes (``convertible``: Mixtral's experts are most of its file); an optimizer's state beside a
    model's weights is not counted against it. Refused where none does, or two that place different
    names do."""
    if given is not None:
        given = given.strip(".") + "." if given.strip(".") else ""
    placed = _pairings(files, model, given)
    if given is None:
        under = {drop: sum(f.startswith(drop) for f in files) for _, drop in placed}
        placed = {
            pair: names
            for pair, names in placed.items()
            if 2 * len(names | {f for f in convertible if f.startswith(pair[1])}) >= under[pair[1]]
        }
    best = max(map(len, placed.values()), default=0)
    if best == 0:
        _refuse_nowhere(files, model, given, max(map(len, _pairings(files, model, given).values()), default=0))
    winners = sorted(pair for pair, names in placed.items() if len(names) == best)
    # pairings that put the same names on the same tensors are one; the same tensors from other names are
    # two copies of the weights (a model and its EMA in one file)
    targets = {pair: frozenset((f, pair[0] + f[len(pair[1]) :]) for f in placed[pair]) for pair in winners}
    if len({frozenset(t for _, t in names) for names in targets.values()}) < len(set(targets.values())):
        drops = sorted({drop for _, drop in winners})
        raise Ambiguous(
            f"the pretrained file holds {best} of the model's tensors under each of {', '.join(map(repr, drops))}: "
            f"two copies of the weights (a model and its EMA, say). Save the one to start from alone, "
            f"torch.save(checkpoint[{drops[0].rstrip('.')!r}], path)"
        )
    if len(set(targets.values())) > 1:
        raise Ambiguous(
            f"the pretrained weights match {best} tensors under each of the modules "
            f"{', '.join(repr(p.rstrip('.')) for p, _ in winners)}: pass TwoBPStrategy(pretrained_prefix=...) "
            f"naming the one they are for"
        )
    return min(winners, key=lambda pair: (len(pair[1]), pair))


def _refuse_nowhere(files: set[str], model: dict[str, Any], given: str | None, best: int) -> None:
    under = f"under the module {given.rstrip('.')!r}" if given is not None else "under any one module"
    fix = (
        "name the module the weights are for (pretrained_prefix='' for the LightningModule itself)"
        if given is not None
        else "pass TwoBPStrategy(pretrained_prefix='<module>') naming the module the weights are for"
    )
    raise ValueError(
        f"{f'only {best}' if best else 'none'} of the pretrained file's {len(files)} tensor names "
        f"({_shown(sorted(files))}) are names of the model's tensors ({_shown(sorted(model))}) {under}: "
        f"{fix}, or save the weights from the same model class"
    )


_EXTRA = "_extra_state"  # a module's get_extra_state() in its state dict: no tensor of the model


def _tensors(module: nn.Module) -> dict[str, Any]:
    """The model's state-dict tensors by every name (on meta or not, as built), a layer peft adapts also
    under its base model's name; a module's extra state is not one (its ``set_extra_state`` is no copy
    into a tensor)."""
    state = {k: v for k, v in module.state_dict(keep_vars=True).items() if not k.endswith(_EXTRA)}
    return conversions.with_adapted_names(state)


def plan(path: str | Path, module: nn.Module, prefix: str | None = None) -> Plan:
    """Which stored tensor goes to which of the model's tensors, every shape and dtype checked: ValueError
    before any read, alike on every rank. The file is read as ``from_pretrained`` reads it into the model's
    Hugging Face model (:func:`.pretrained_conversions.hugging_face_view`) where that places at least as many
    of its names as placing them by their trailing parts does (a checkpoint of the LightningModule's own,
    a plain module's), or places at least half of them where trailing parts place none; else by those.
    Names that fit two places alike are refused either way."""
    source = read_headers(Path(path))
    entries, model = source.entries, _tensors(module)
    shapes = {f: e.shape for f, e in entries.items()}
    given = None if prefix is None else prefix.strip(".") + "." if prefix.strip(".") else ""
    view = conversions.hugging_face_view(module, set(entries), shapes, given)
    try:
        names, converted, prefix = _by_suffix_view(entries, model, module, given)
    except Ambiguous:
        raise
    except ValueError:  # fits nowhere by trailing parts: read as from_pretrained reads it, if that places most
        if view is None or 2 * view.placed < len(entries):
            raise
        names, converted, prefix = view.names, view.converted, view.path
    else:
        if view is not None and view.placed >= len(set(names.values())) + len(converted.sources):
            names, converted, prefix = view.names, view.converted, view.path
    names = _with_aliases(names, model)
    placed = set(names) | converted.outputs
    missing = [k for k in module.state_dict(keep_vars=True) if k.endswith(_EXTRA) or k not in placed]
    unused = sorted(set(entries) - set(names.values()) - converted.sources)
    _check_values(source, names, model, converted)
    _check_quantized_leftovers(source, missing, unused)
    keys = {name: entries[f].key for name, f in names.items()}
    return Plan(source, prefix, keys, tuple(sorted(missing)), tuple(unused), converted)


def _by_suffix_view(
    entries: dict[str, Any], model: dict[str, Any], module: nn.Module, given: str | None
) -> tuple[dict[str, str], Converted, str]:
    """The file's names placed under the module path their trailing parts fit (:func:`_find_prefix`), the
    names left over through the conversions of the Hugging Face models there."""
    files = set(entries)
    prefix, drop = _find_prefix(files, model, given, conversions.convertible(module, files))
    names = {n: drop + n[len(prefix) :] for n in model if n.startswith(prefix) and drop + n[len(prefix) :] in files}
    unused = sorted(files - set(names.values()))
    unset = [n for n in model if n.startswith(prefix) and n not in names]
    shapes = {f: entries[f].shape for f in unused}
    converted = conversions.plan_conversions(module, prefix, drop, unset, unused, shapes)
    return names | converted.renamed, Converted({}, converted.conversions), prefix


def _with_aliases(names: dict[str, str], model: dict[str, Any]) -> dict[str, str]:
    """Each placed tensor under every name of it (a rank may hold a tied weight under another), read
    through the first of its names placed; the file's other names for it are then not read."""
    by_tensor: dict[int, list[str]] = defaultdict(list)
    for name, tensor in model.items():
        by_tensor[id(tensor)].append(name)
    out: dict[str, str] = {}
    for aliases in by_tensor.values():
        found = [n for n in aliases if n in names]
        if found:
            out.update(dict.fromkeys(aliases, names[found[0]]))
    return out


# what a quantized checkpoint stores beside (or in place of) a weight: its blocks, scales, zeros
_QUANTIZED = ("_blocks", "_scales", "_scale_inv", ".qweight", ".qzeros", ".scales", ".absmax", ".SCB")


def _check_quantized_leftovers(source: Source, missing: list[str], unused: list[str]) -> None:
    """A quantized checkpoint's parts left unread where the model's weight of that name stays unset
    (GPT-OSS's MXFP4 ``gate_up_proj_blocks`` and ``_scales``): refused, as a quantized tensor stored under
    the weight's own name is (:func:`_check_values`)."""
    for f in unused:
        stem = next((f[: -len(q)] for q in _QUANTIZED if f.endswith(q)), None)
        unset = next((m for m in missing if stem and (m.endswith(stem) or stem.endswith(m))), None)
        if unset is not None:
            raise ValueError(
                f"the pretrained weights in {source.path} are quantized: {f} ({source.entries[f].dtype}) is a part of "
                f"{unset}, whose value needs the checkpoint's dequantization. Use the checkpoint's unquantized "
                f"release, or dequantize it once (from_pretrained with the quantizer, then save_pretrained)"
            )


def _check_values(source: Source, names: dict[str, str], model: dict[str, Any], converted: Converted) -> None:
    """Every shape as the model's (a conversion's outputs: checked when planned); no float tensor of the
    model read from a quantized one (float8, int)."""
    wrong, quantized = [], []
    read = [(model[name], f) for name, f in names.items()]
    read += [(model[c.outputs[0]], f) for c in converted.conversions for f, _ in c.sources]
    for name, f in names.items():
        entry, tensor = source.entries[f], model[name]
        if tuple(tensor.shape) != entry.shape:
            wrong.append(f"{name}: {tuple(tensor.shape)} in the model, {entry.shape} in the file")
    for tensor, f in read:
        if tensor.is_floating_point() and source.entries[f].dtype not in FLOATS:
            quantized.append(f"{f} ({source.entries[f].dtype})")
    if wrong:
        raise ValueError(
            f"the pretrained weights in {source.path} do not fit the model: {len(wrong)} tensor(s) differ in shape: "
            f"{_shown(wrong)}. Build the model with the config the weights were saved with"
        )
    if quantized:
        raise ValueError(
            f"the pretrained weights in {source.path} are quantized: {len(quantized)} tensor(s) the model holds in "
            f"floating point are stored as {_shown(quantized)}, whose values need the checkpoint's scales. Use "
            f"the checkpoint's unquantized release, or dequantize it once and save it with safetensors"
        )


def warn_unmatched(p: Plan) -> None:
    """What the file lacks and what it holds beyond the model, once (as Hugging Face's loading says it),
    and which of a folder's saves is read where it holds two."""
    for note in p.source.notes:
        rank_zero_warn(f"twobp: pretrained: {note}")
    if p.missing:
        rank_zero_warn(
            f"twobp: {len(p.missing)} tensor(s) of the model are not in the pretrained weights {p.path} and keep "
            f"the values the model was built with: {_shown(p.missing)}"
        )
    if p.unused:
        rank_zero_warn(
            f"twobp: {len(p.unused)} tensor(s) in {p.path} are not the model's and are not read: {_shown(p.unused)}"
        )


def read_before(module: nn.Module) -> str | None:
    """What was read into the model in an earlier call (the directory, or a checkpoint's), or None."""
    return _READ.get(module)


def mark_read(module: nn.Module, what: str) -> None:
    """The model holds its weights from now on (``what`` was read into it): later Trainer calls leave them be."""
    _READ[module] = what


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
        with torch.no_grad(), warnings.catch_warnings():
            # each rank reads on its own (no_dist), and torch says it assumes one process: that is the intent
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            p.source.read(state)
            for tensor, key in copies:
                tensor.copy_(state[key])
    return len(state) + conversions.apply(p.converted, p.source, module)
