"""transformers' checkpoint conversions for ``pretrained=`` (:mod:`.pretrained`).

A Hub checkpoint may name tensors otherwise than the model does: ``from_pretrained`` renames some (an
old BERT's ``LayerNorm.gamma``, Mixtral's ``block_sparse_moe``) and fuses others (Mixtral's and most
mixture-of-experts models' experts: one tensor per expert in the file, one stacked tensor in the
model). Here transformers' own mapping (``get_model_conversion_mapping``) finds them and its own
operations convert them, per rank, on the tensors the rank holds:

* :func:`hugging_face_view`, before any read and alike on every rank: the whole file read as
  ``from_pretrained`` reads it into the model's one outermost Hugging Face model (every name through
  ``rename_source_key``: renamed, its base-model prefix added or dropped, or joined to the conversion
  of its target, a layer's experts). :mod:`.pretrained` takes it where it places at least as many of the
  file's names as placing them by their trailing parts does.
* :func:`plan_conversions`, for that other placing: the names it leaves over, through the mapping of the
  Hugging Face model they fall under.
* Either way each conversion is run on meta tensors of the stored shapes, which gives the names and
  shapes it writes, checked against the model's.
* :func:`apply`, after the cut: a rank reads the sources of each conversion whose outputs it holds (one
  conversion at a time: a layer's experts twice at most), converts them and copies the result in.

A layer peft adapts answers to its base model's name too (:func:`with_adapted_names`).
"""

from __future__ import annotations

import copy
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_twobp.lightning.pretrained_files import Source

__all__ = [
    "NOTHING",
    "Conversion",
    "Converted",
    "HuggingFaceView",
    "apply",
    "convertible",
    "hugging_face_models",
    "hugging_face_view",
    "mapping",
    "plan_conversions",
    "run",
    "with_adapted_names",
]


@dataclass(frozen=True)
class Conversion:
    """One of transformers' converters for one target: the file's names it reads, the model's it writes."""

    sub: str  # the module path of the Hugging Face model whose mapping converts ("" or ending in ".")
    layer: str  # the first target's name in that model, from which the converter names its outputs
    sources: tuple[tuple[str, str], ...]  # (the file's name, the converter's source pattern), in load order
    outputs: tuple[str, ...]  # the model's names it writes
    converter: Any  # transformers' WeightConverter, unused: each run takes a copy


@dataclass(frozen=True)
class Converted:
    """What the mapping places: plain renames (the model's name -> the file's) and conversions."""

    renamed: dict[str, str]
    conversions: tuple[Conversion, ...]

    @property
    def sources(self) -> set[str]:
        return set(self.renamed.values()) | {f for c in self.conversions for f, _ in c.sources}

    @property
    def outputs(self) -> set[str]:
        return set(self.renamed) | {n for c in self.conversions for n in c.outputs}


NOTHING = Converted({}, ())

_PEFT = ".base_layer."  # peft's adapter layers hold the layer they adapt under it


def with_adapted_names(state: dict[str, Any]) -> dict[str, Any]:
    """The model's tensors by name, a layer peft adapts (``q_proj.base_layer.weight``) also under the name
    the base model's checkpoint gives it (``q_proj.weight``), as peft's own loading maps it."""
    adapted = {k.replace(_PEFT, ".", 1): v for k, v in state.items() if _PEFT in k}
    return state | {k: v for k, v in adapted.items() if k not in state}


def hugging_face_models(module: nn.Module, prefix: str) -> list[tuple[str, Any]]:
    """The Hugging Face models around or under ``prefix`` (a module path), with their paths."""
    if "transformers" not in sys.modules:
        return []
    from transformers import PreTrainedModel

    found = []
    for name, sub in module.named_modules():
        path = f"{name}." if name else ""
        if isinstance(sub, PreTrainedModel) and (path.startswith(prefix) or prefix.startswith(path)):
            found.append((path, sub))
    return found


def mapping(sub: Any) -> list[Any]:
    """transformers' conversions of ``sub``'s checkpoint names (none before transformers 5)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return []
    return list(get_model_conversion_mapping(sub))


@dataclass(frozen=True)
class HuggingFaceView:
    """The file read as ``from_pretrained`` reads it into the one Hugging Face model at ``path``: each name
    renamed by transformers (its base-model prefix added or dropped), the fused ones converted."""

    path: str
    names: dict[str, str]  # the model's name -> the file's name
    converted: Converted

    @property
    def placed(self) -> int:
        return len(set(self.names.values())) + len(self.converted.sources)


def hugging_face_view(
    module: nn.Module, files: set[str], shapes: dict[str, tuple[int, ...]], given: str | None
) -> HuggingFaceView | None:
    """``from_pretrained``'s reading of the file (names and conversions) into the model's one outermost
    Hugging Face model (at ``given``, where given); None where there is not exactly one, or before
    transformers 5 (no mapping to follow: names are read as saved)."""
    found = hugging_face_models(module, "")
    roots = [(p, m) for p, m in found if not any(q != p and p.startswith(q) for q, _ in found)]
    if len(roots) != 1 or (given is not None and given != roots[0][0]):
        return None
    try:
        from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key
    except ImportError:
        return None
    path, sub = roots[0]
    transforms = mapping(sub)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    rename = _renamer(sub, transforms, converters)
    meta = with_adapted_names(dict(sub.state_dict(keep_vars=True)))
    own = {k for k in meta if not k.endswith("_extra_state")}
    names: dict[str, str] = {}
    groups: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for f in sorted(files, key=dot_natural_key):
        target, pattern = rename(f)
        if target not in own and f in own:  # as from_pretrained: the name as saved, its base prefix fixed
            target, pattern = rename_source_key(f, [], [], sub.base_model_prefix, meta)
        if target not in own:
            continue
        if pattern is None:
            names.setdefault(path + target, f)
        else:
            groups[target].append((f, pattern))
    model = with_adapted_names(dict(module.state_dict(keep_vars=True)))
    planned = tuple(
        _planned(path, target, sources, by_pattern[sources[0][1]], sub, model, shapes)
        for target, sources in groups.items()
    )
    return HuggingFaceView(path, names, Converted({}, planned))


def convertible(module: nn.Module, files: set[str]) -> frozenset[str]:
    """The file's names a conversion of one of the model's Hugging Face models takes (by its patterns)."""
    transforms = [t for _, sub in hugging_face_models(module, "") for t in mapping(sub)]
    return frozenset(f for f in files if any(t.compiled_sources.search(f) for t in transforms))


def plan_conversions(
    module: nn.Module, prefix: str, drop: str, unset: list[str], unused: list[str], shapes: dict[str, tuple[int, ...]]
) -> Converted:
    """Place the file's ``unused`` names (``shapes``: each one's stored shape) on the model's ``unset``
    names through transformers' mappings; ValueError naming the conversion where one fails or writes a
    shape the model does not hold."""
    if not unset or not unused:
        return NOTHING
    from transformers.core_model_loading import WeightConverter, dot_natural_key

    unset_set, model = set(unset), with_adapted_names(dict(module.state_dict(keep_vars=True)))
    renamed: dict[str, str] = {}
    groups: dict[tuple[str, str], list[tuple[str, str]]] = defaultdict(list)
    templates: dict[tuple[str, str], Any] = {}
    taken: set[str] = set()
    for path, sub in hugging_face_models(module, prefix):
        transforms = mapping(sub)
        if not transforms:
            continue
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        rename = _renamer(sub, transforms, converters)
        for f in sorted(set(unused) - taken, key=dot_natural_key):
            full = prefix + f[len(drop) :] if f.startswith(drop) else None
            if full is None or not full.startswith(path):
                continue
            target, pattern = rename(full[len(path) :])
            if path + target not in model:
                continue
            if pattern is None:
                if path + target in unset_set:
                    renamed[path + target] = f
                    taken.add(f)
                continue
            groups[(path, target)].append((f, pattern))
            templates[(path, target)] = by_pattern[pattern]
            taken.add(f)
    subs = dict(hugging_face_models(module, prefix))
    conversions = tuple(
        _planned(path, target, sources, templates[(path, target)], subs[path], model, shapes)
        for (path, target), sources in groups.items()
    )
    return Converted(renamed, conversions)


def _renamer(sub: Any, transforms: list[Any], converters: list[Any]) -> Callable[[str], tuple[str, str | None]]:
    """A file's name in ``sub`` -> (the model's name, the converter's source pattern or None), as
    ``from_pretrained`` renames it."""
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    meta = with_adapted_names(dict(sub.state_dict(keep_vars=True)))
    return lambda key: rename_source_key(key, renamings, converters, sub.base_model_prefix, meta)


def _planned(
    path: str,
    target: str,
    sources: list[tuple[str, str]],
    template: Any,
    sub: Any,
    model: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
) -> Conversion:
    """The conversion run on meta tensors of the stored shapes: its outputs, each checked against the model."""
    conversion = Conversion(path, target, tuple(sources), (), template)
    out = run(conversion, sub, {f: torch.empty(shapes[f], device="meta") for f, _ in sources})
    wrong = [
        f"{path}{name}: {tuple(model[path + name].shape)} in the model, {tuple(value.shape)} converted"
        for name, value in out.items()
        if path + name in model and tuple(model[path + name].shape) != tuple(value.shape)
    ]
    lost = [path + name for name in out if path + name not in model]
    if wrong or lost:
        raise ValueError(
            f"transformers' conversion {template} of {', '.join(f for f, _ in sources[:3])}... does not fit the model "
            f"({'; '.join(wrong) or f'it writes {lost}, which the model does not hold'}). Build the model with the "
            f"config the weights were saved with"
        )
    return Conversion(path, target, tuple(sources), tuple(path + name for name in out), template)


def run(conversion: Conversion, sub: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The converter on ``tensors`` (by the file's name): the model's tensors it makes, by their names in
    ``sub``; ValueError naming the conversion where transformers' operation fails."""
    converter = copy.deepcopy(conversion.converter)
    for f, pattern in conversion.sources:
        converter.add_tensor(conversion.layer, f, pattern, lambda t=tensors[f]: t)
    try:
        out = converter.convert(conversion.layer, model=sub, config=sub.config)
    except Exception as err:  # noqa: BLE001 - transformers' operation, named with what it was given
        raise ValueError(
            f"transformers' conversion {conversion.converter} failed on {len(conversion.sources)} tensor(s) of the "
            f"pretrained file for {conversion.sub}{conversion.layer} ({type(err).__name__}: {err})"
        ) from err
    return {name: value[0] if isinstance(value, list) else value for name, value in out.items()}


def apply(converted: Converted, source: Source, module: nn.Module) -> int:
    """Run the conversions whose outputs this rank holds (other ranks' layers are set aside or on meta), each on its
    sources read from ``source``; the number of the model's tensors written."""
    tensors = with_adapted_names(dict(module.state_dict(keep_vars=True)))
    written = 0
    for conversion in converted.conversions:
        held = [n for n in conversion.outputs if n in tensors and not tensors[n].is_meta]  # set aside or meta
        if not held:
            continue
        dtype = tensors[held[0]].dtype
        entries = {f: source.entries[f] for f, _ in conversion.sources}
        read = {e.key: torch.empty(e.shape, dtype=dtype) for e in entries.values()}
        source.read(read)
        sub = module.get_submodule(conversion.sub.rstrip(".")) if conversion.sub else module
        out = run(conversion, sub, {f: read[e.key] for f, e in entries.items()})
        with torch.no_grad():
            for name in held:
                tensors[name].copy_(out[name[len(conversion.sub) :]])
        written += len(held)
    return written
