"""What pretrained weights hold, from their headers only: for ``pretrained=`` (:mod:`.pretrained`).

Four kinds:

* ``"safetensors"``: Hugging Face's (``save_pretrained``, a Hub snapshot), read with
  ``torch.distributed.checkpoint``'s ``HuggingFaceStorageReader``, which takes every ``*.safetensors`` of
  its folder: where only some are to be read (an index's, beside Mistral's ``consolidated.safetensors``;
  one file named alone) it is given a folder of links to those. A key in two files read is refused (the
  reader would take either, tensor by tensor).
* ``"ours"``: a checkpoint directory of this strategy (``meta.pt`` beside DCP's ``.metadata``), its model's
  weights under ``model.``, seen without it.
* ``"dcp"``: another ``torch.distributed.checkpoint`` directory, by its own names.
* ``"torch"``: ``torch.save`` files (``pytorch_model.bin``, sharded with its index, a Lightning ``.ckpt``,
  a saved state dict), memory-mapped (``torch.load(mmap=True, weights_only=True)``): unpickling makes
  no tensor's bytes, so a rank touches the pages of its own tensors only, as with safetensors. A
  Lightning checkpoint's ``state_dict`` is read; another file's tensors by their dotted path through its
  mappings (``{"model": ..., "optimizer": ...}`` gives ``model.<name>``, which :mod:`.pretrained` places
  under the model as it places a causal LM's ``model.``).

A Hugging Face folder is read as ``from_pretrained`` reads it: ``model.safetensors``, else its index's
files, else ``pytorch_model.bin``, else its index's; another folder's every ``*.safetensors``. Names
under ``torch.compile``'s ``_orig_mod.`` are read as the plain model's.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import weakref
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

__all__ = ["FLOATS", "Entry", "Source", "not_mappable", "read_headers"]

_OURS = "model."  # this strategy's checkpoints hold the model's weights under it, beside the optimizers' state
_META = "meta.pt"  # lightning.checkpoint.META: what tells this strategy's checkpoint from another DCP one
_SAFE, _INDEX = "model.safetensors", "model.safetensors.index.json"
_BIN, _BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"  # what save_pretrained wrote before safetensors
_COMPILED = "_orig_mod."  # torch.compile's wrapper holds the module under it
_EXTRA = "_extra_state"  # a module's get_extra_state(), beside its tensors in a state dict
_LFS = "a file of a few hundred bytes is a Git LFS pointer (git lfs pull fetches the weights)"


# the stored dtypes a float tensor of the model is read from by a cast (safetensors' names and torch's):
# a float8 or integer tensor in their place is a quantized checkpoint, whose values need its scales
_TORCH_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
FLOATS = frozenset({"F64", "F32", "F16", "BF16"} | {str(t) for t in _TORCH_FLOATS})


@dataclass(frozen=True)
class Entry:
    """One stored tensor: the key it is stored under, its shape, its dtype's name and, for a torch file, the
    file."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    file: Path | None = None


@dataclass(frozen=True)
class Source:
    """Stored tensors by the name the model sees each under, and how to read them."""

    path: Path  # the directory or file the user named
    kind: str  # "safetensors", "ours", "dcp" or "torch"
    folder: Path  # the folder the reader reads (for an index, its links to the indexed files)
    entries: dict[str, Entry]
    notes: tuple[str, ...] = ()  # what the user should know of the choice of files (said once, by rank 0)

    def read(self, state: dict[str, torch.Tensor]) -> None:
        """Fill ``state``'s tensors (by stored key) in place, each cast to its tensor's dtype."""
        if self.kind == "torch":
            _read_torch(self, state)
            return
        reader = dcp.HuggingFaceStorageReader(str(self.folder)) if self.kind == "safetensors" else None
        dcp.load(
            state,
            storage_reader=reader or dcp.FileSystemReader(self.folder),
            planner=DefaultLoadPlanner(allow_partial_load=True),
            no_dist=True,  # each rank reads on its own
        )


@dataclass(frozen=True)
class _Found:
    kind: str
    files: list[Path]  # the safetensors or torch files to read (none for DCP)
    notes: tuple[str, ...] = ()


def read_headers(path: Path) -> Source:
    """The tensors of the directory or file, from its headers; ValueError naming the file where one cannot
    be read."""
    found = _choose(path)
    if found.kind in ("dcp", "ours"):
        return Source(path, found.kind, path, _dcp(path, found.kind))
    if found.kind == "torch":
        entries = _torch_entries(found.files)
        return Source(path, "torch", path if path.is_dir() else path.parent, _canonical(entries), found.notes)
    try:
        import safetensors  # noqa: F401 - the reader imports it inside; named here, before any read
    except ImportError as err:
        raise ImportError(f"pretrained={str(path)!r}: reading safetensors needs pip install safetensors") from err
    entries = _safetensors_entries(path, found.files)
    whole = path.is_dir() and found.files == sorted(path.glob("*.safetensors"))
    folder = path if whole else _linked(found.files)  # the reader takes every *.safetensors of its folder
    source = Source(path, "safetensors", folder, _canonical(entries), found.notes)
    if folder != path:  # the links go with the plan that reads through them
        weakref.finalize(source, shutil.rmtree, folder, ignore_errors=True)
    return source


def _choose(path: Path) -> _Found:
    """What to read, in from_pretrained's order for a Hugging Face folder (``model.safetensors``, its
    index, ``pytorch_model.bin``, its index), else every ``*.safetensors`` of the folder."""
    if path.is_file():
        return _Found("safetensors" if path.suffix == ".safetensors" else "torch", [path])
    if (path / ".metadata").is_file():
        return _Found("ours" if (path / _META).is_file() else "dcp", [])
    for kind, single, index in (("safetensors", _SAFE, _INDEX), ("torch", _BIN, _BIN_INDEX)):
        if (path / single).is_file():
            notes = (_two_saves(path, single, index),) if (path / index).is_file() else ()
            return _Found(kind, [path / single], notes)
        if (path / index).is_file():
            return _Found(kind, _listed(path, index))
    return _Found("safetensors", sorted(path.glob("*.safetensors")))


def _two_saves(path: Path, single: str, index: str) -> str:
    return (
        f"{path} holds {single} and {index}: {single} is read, as from_pretrained reads it (the index's files are "
        f"another save: remove the one not wanted)"
    )


def _listed(path: Path, index: str) -> list[Path]:
    """The files an index lists."""
    names = sorted(set(json.loads((path / index).read_text())["weight_map"].values()))
    lost = [n for n in names if not (path / n).is_file()]
    if lost:
        raise ValueError(f"pretrained: {path / index} lists {', '.join(lost)}, which {path} does not hold")
    return [path / n for n in names]


def _canonical(entries: dict[str, Entry]) -> dict[str, Entry]:
    """The names a compiled model's state dict holds (``torch.compile``'s ``_orig_mod.``) as the plain
    model's, which is what the strategy pipelines."""
    return {k.replace(_COMPILED, ""): e for k, e in entries.items()}


def _dcp(path: Path, kind: str) -> dict[str, Entry]:
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    tensors = {
        k: Entry(k, tuple(m.size), str(m.properties.dtype))
        for k, m in saved.items()
        if isinstance(m, TensorStorageMetadata)
    }
    if kind == "dcp":
        return tensors
    return {k[len(_OURS) :]: e for k, e in tensors.items() if k.startswith(_OURS)}


def _linked(files: list[Path]) -> Path:
    """A folder of links to ``files``, in the temporary directory (removed with its :class:`Source`)."""
    folder = Path(tempfile.mkdtemp(prefix="twobp-pretrained-"))
    for file in files:
        (folder / file.name).symlink_to(file.resolve())
    return folder


def _safetensors_entries(path: Path, files: list[Path]) -> dict[str, Entry]:
    from safetensors import safe_open

    entries: dict[str, Entry] = {}
    where: dict[str, list[str]] = defaultdict(list)
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - a safetensors handle, not a mapping
                    part = f.get_slice(key)
                    entries[key] = Entry(key, tuple(part.get_shape()), part.get_dtype())
                    where[key].append(file.name)
        except Exception as err:  # noqa: BLE001 - named with the file and the likely cause
            raise ValueError(
                f"pretrained: the header of {file} cannot be read ({type(err).__name__}: {err}); {_LFS}"
            ) from err
    _refuse_twice(path, where)
    return entries


def _refuse_twice(path: Path, where: dict[str, list[str]]) -> None:
    twice = {k: names for k, names in where.items() if len(names) > 1}
    if twice:
        key, names = next(iter(twice.items()))
        raise ValueError(
            f"pretrained: {len(twice)} tensor(s) are in more than one file of {path} ({key} in {', '.join(names)}) "
            f"and no {_INDEX} says which to read: the folder holds two saves. Keep the files of one save in a "
            f"folder of their own"
        )


def _torch_entries(files: list[Path]) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    where: dict[str, list[str]] = defaultdict(list)
    for file in files:
        for key, value in _state_dict(file).items():
            entries[key] = Entry(key, tuple(value.shape), str(value.dtype), file)
            where[key].append(file.name)
    _refuse_twice(files[0].parent, where)
    return entries


def _state_dict(file: Path) -> dict[str, torch.Tensor]:
    """The tensors a torch file holds by dotted name, memory-mapped (no tensor's bytes read): ValueError
    naming the fix where it cannot be mapped, holds objects beyond tensors, or tensors without data."""
    try:
        saved = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as err:
        if "mmap" not in str(err):
            raise ValueError(f"pretrained: {file} cannot be read by torch.load ({_first_lines(err)})") from err
        raise ValueError(f"pretrained: {file} cannot be memory-mapped: {not_mappable(file)}") from err
    except Exception as err:  # noqa: BLE001 - an unpickling error: named with the safe way out
        raise ValueError(
            f"pretrained: {file} holds Python objects beyond tensors, which torch.load(weights_only=True) does not "
            f"make ({_first_lines(err)}). If you trust the file, allow them before fit "
            f"(torch.serialization.add_safe_globals([...]) with the classes named), or save its state dict alone "
            f"(torch.save(checkpoint['state_dict'], path)) or as safetensors"
        ) from err
    found = _tensors_of(saved)
    bad = [k for k, v in found.items() if v.is_meta or isinstance(v, DTensor)]
    if not found or bad:
        what = f"tensors without data or shards of a sharded save ({', '.join(bad[:3])})" if bad else "no named tensors"
        raise ValueError(
            f"pretrained: {file} holds {what}: save the model's whole state dict (from a model on a real device; "
            f"a sharded model through torch.distributed.checkpoint, whose directory pretrained= reads)"
        )
    return found


def not_mappable(file: Path) -> str:
    """Why a file is no torch.save zip archive, and the fix."""
    with open(file, "rb") as fh:
        head = fh.read(200)
    if head.startswith(b"version https://git-lfs"):
        return f"it is a Git LFS pointer, not the weights ({_LFS})"
    if not head:
        return "it is empty (an interrupted download or save)"
    return (
        "it is in torch's legacy format (torch.save before torch 1.6, or _use_new_zipfile_serialization=False), "
        "or no torch file, and every rank would read a legacy file whole: load it once and torch.save it again, "
        "or save it as safetensors"
    )


def _first_lines(err: Exception) -> str:
    """torch's message without its terminal colours, cut to the lines that name the cause."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    named = [ln for ln in lines if "Unsupported global" in ln or "GLOBAL" in ln]
    return f"{type(err).__name__}: {' '.join((named or lines[:1])[:2])}"


def _tensors_of(saved: Any) -> dict[str, torch.Tensor]:
    """The tensors of ``saved`` by dotted name through its mappings of string keys (an optimizer's state,
    keyed by index, and lists are left out); a Lightning checkpoint's ``state_dict`` alone. A module's
    ``_extra_state`` is left out: it is no tensor of the model."""
    if isinstance(saved, Mapping) and isinstance(saved.get("state_dict"), Mapping) and saved["state_dict"]:
        saved = saved["state_dict"]  # Lightning's checkpoint, its loops' and optimizers' state beside it
    out: dict[str, torch.Tensor] = {}
    stack: list[tuple[str, Any]] = [("", saved)]
    while stack:
        prefix, value = stack.pop()
        if isinstance(value, torch.Tensor) and prefix:
            out[prefix[:-1]] = value
        elif isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            stack.extend((f"{prefix}{k}.", v) for k, v in value.items() if not k.endswith(_EXTRA))
    return dict(sorted(out.items()))


def _read_torch(source: Source, state: dict[str, torch.Tensor]) -> None:
    """Each file's mapped tensors copied into ``state``'s: the pages of the tensors read, no others."""
    by_file: dict[Path, list[str]] = defaultdict(list)
    for entry in source.entries.values():
        if entry.key in state and entry.file is not None:
            by_file[entry.file].append(entry.key)
    for file, keys in by_file.items():
        saved = _state_dict(file)
        for key in keys:
            state[key].copy_(saved[key])
