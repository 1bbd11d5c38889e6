"""What pretrained weights hold, from their headers only: for ``pretrained=`` (:mod:`.pretrained`).

Four kinds:

* ``"safetensors"``: Hugging Face's (``save_pretrained``, a Hub snapshot), read with
  ``torch.distributed.checkpoint``'s ``HuggingFaceStorageReader``. Where ``model.safetensors.index.json``
  is present only the files it lists are read, as ``from_pretrained`` reads them (a Hub snapshot may hold
  another copy of the weights beside them, Mistral's ``consolidated.safetensors``, and ``save_pretrained``
  leaves an earlier ``model.safetensors`` beside new shards); the reader, which takes every
  ``*.safetensors`` of its folder, is given a folder of links to those (one file named alone, likewise).
  Without an index, a key in two files is refused (the reader would take either, tensor by tensor).
* ``"ours"``: a checkpoint directory of this strategy (``meta.pt`` beside DCP's ``.metadata``), its model's
  weights under ``model.``, seen without it.
* ``"dcp"``: another ``torch.distributed.checkpoint`` directory, by its own names.
* ``"torch"``: ``torch.save`` files (``pytorch_model.bin``, sharded with its index, a Lightning ``.ckpt``,
  a saved state dict), memory-mapped (``torch.load(mmap=True, weights_only=True)``): unpickling makes
  no tensor's bytes, so a rank touches the pages of its own tensors only, as with safetensors. The state
  dict is the file's mapping of tensors, a Lightning checkpoint's ``state_dict``, or the one mapping of
  tensors among the file's entries (``{"model": ..., "optimizer": ...}``).
"""

from __future__ import annotations

import json
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

__all__ = ["FLOATS", "Entry", "Source", "read_headers"]

_OURS = "model."  # this strategy's checkpoints hold the model's weights under it, beside the optimizers' state
_META = "meta.pt"  # lightning.checkpoint.META: what tells this strategy's checkpoint from another DCP one
_INDEX = "model.safetensors.index.json"
_BIN, _BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"  # what save_pretrained wrote before safetensors


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
    """A directory's tensors by the name the model sees each under, and how to read them."""

    path: Path  # the directory or file the user named
    kind: str  # "safetensors", "ours", "dcp" or "torch"
    folder: Path  # the folder the reader reads (for an index, its links to the indexed files)
    entries: dict[str, Entry]

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


def read_headers(path: Path) -> Source:
    """The tensors of the directory or file, from its headers; ValueError naming the file where one cannot
    be read."""
    if path.is_file() and path.suffix != ".safetensors":
        return _torch_files(path, [path])
    if (path / ".metadata").is_file():
        return _dcp(path)
    if (
        path.is_dir()
        and not any(path.glob("*.safetensors"))
        and ((path / _BIN_INDEX).is_file() or (path / _BIN).is_file())
    ):
        return _torch_files(path, _bin_files(path))
    try:
        import safetensors  # noqa: F401 - the reader imports it inside; named here, before any read
    except ImportError as err:
        raise ImportError(f"pretrained={str(path)!r}: reading safetensors needs pip install safetensors") from err
    files = [path] if path.is_file() else _indexed(path)
    folder = _linked(files) if path.is_file() or (path / _INDEX).is_file() else path
    source = Source(path, "safetensors", folder, _safetensors_entries(path, files))
    if folder != path:  # the links go with the plan that reads through them
        weakref.finalize(source, shutil.rmtree, folder, ignore_errors=True)
    return source


def _dcp(path: Path) -> Source:
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    tensors = {
        k: Entry(k, tuple(m.size), str(m.properties.dtype))
        for k, m in saved.items()
        if isinstance(m, TensorStorageMetadata)
    }
    if not (path / _META).is_file():
        return Source(path, "dcp", path, tensors)
    return Source(path, "ours", path, {k[len(_OURS) :]: e for k, e in tensors.items() if k.startswith(_OURS)})


def _indexed(path: Path) -> list[Path]:
    """The safetensors files to read: those the index lists, else every one of the folder."""
    if not (path / _INDEX).is_file():
        return sorted(path.glob("*.safetensors"))
    names = sorted(set(json.loads((path / _INDEX).read_text())["weight_map"].values()))
    lost = [n for n in names if not (path / n).is_file()]
    if lost:
        raise ValueError(f"pretrained: {path / _INDEX} lists {', '.join(lost)}, which {path} does not hold")
    return [path / n for n in names]


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
                f"pretrained: the header of {file} cannot be read ({type(err).__name__}: {err}); a file of a few "
                f"hundred bytes is a Git LFS pointer (git lfs pull fetches the weights)"
            ) from err
    twice = {k: names for k, names in where.items() if len(names) > 1}
    if twice:
        key, names = next(iter(twice.items()))
        raise ValueError(
            f"pretrained: {len(twice)} tensor(s) are in more than one file of {path} ({key} in {', '.join(names)}) "
            f"and no {_INDEX} says which to read: the folder holds two saves. Keep the files of one save in a "
            f"folder of their own"
        )
    return entries


def _holds_bin(path: Path) -> bool:
    """A directory of ``pytorch_model.bin`` files and no safetensors (from_pretrained prefers those)."""
    has_bin = (path / _BIN_INDEX).is_file() or (path / _BIN).is_file()
    return path.is_dir() and has_bin and not any(path.glob("*.safetensors"))


def _bin_files(path: Path) -> list[Path]:
    """The torch files of a directory without safetensors: those ``pytorch_model.bin.index.json`` lists, else
    ``pytorch_model.bin``."""
    if not (path / _BIN_INDEX).is_file():
        return [path / _BIN]
    names = sorted(set(json.loads((path / _BIN_INDEX).read_text())["weight_map"].values()))
    lost = [n for n in names if not (path / n).is_file()]
    if lost:
        raise ValueError(f"pretrained: {path / _BIN_INDEX} lists {', '.join(lost)}, which {path} does not hold")
    return [path / n for n in names]


def _torch_files(path: Path, files: list[Path]) -> Source:
    entries: dict[str, Entry] = {}
    for file in files:
        for key, value in _state_dict(file).items():
            if key in entries:
                raise ValueError(
                    f"pretrained: {key} is in both {entries[key].file} and {file}: the folder holds two saves. "
                    f"Keep the files of one save in a folder of their own"
                )
            entries[key] = Entry(key, tuple(value.shape), str(value.dtype), file)
    return Source(path, "torch", path.parent if path.is_file() else path, entries)


def _state_dict(file: Path) -> Mapping[str, torch.Tensor]:
    """The tensors a torch file holds, memory-mapped (no tensor's bytes read): ValueError naming the fix
    where it cannot be mapped, holds objects beyond tensors, or no one mapping of them."""
    try:
        saved = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as err:
        if "mmap" not in str(err):
            raise ValueError(f"pretrained: {file} cannot be read by torch.load ({err})") from err
        raise ValueError(
            f"pretrained: {file} is in torch's legacy format (torch.save before torch 1.6, or "
            f"_use_new_zipfile_serialization=False), which cannot be memory-mapped, so every rank would read it "
            f"whole: load it once and torch.save it again, or save it as safetensors"
        ) from err
    except Exception as err:  # noqa: BLE001 - an unpickling error: named with the safe way out
        raise ValueError(
            f"pretrained: {file} holds Python objects beyond tensors, which torch.load(weights_only=True) does not "
            f"make ({type(err).__name__}: {str(err).splitlines()[0]}); save its state dict alone "
            f"(torch.save(model.state_dict(), path)) or as safetensors"
        ) from err
    found = _tensors_of(saved)
    if found is None:
        keys = list(saved) if isinstance(saved, Mapping) else type(saved).__name__
        raise ValueError(
            f"pretrained: {file} holds no one mapping of names to tensors (its entries: {keys}): save the state "
            f"dict you want alone, torch.save(checkpoint['<entry>'], path)"
        )
    return found


def _tensors_of(saved: Any) -> Mapping[str, torch.Tensor] | None:
    """A state dict, a Lightning checkpoint's ``state_dict``, or the one state dict among ``saved``'s
    entries; None where there is none or several."""
    if _is_state_dict(saved):
        return {k: v for k, v in saved.items() if isinstance(v, torch.Tensor)}
    if not isinstance(saved, Mapping):
        return None
    if _is_state_dict(saved.get("state_dict")):  # Lightning's checkpoint, its optimizers' state beside it
        return _tensors_of(saved["state_dict"])
    inner = [v for v in saved.values() if _is_state_dict(v)]
    return _tensors_of(inner[0]) if len(inner) == 1 else None


def _is_state_dict(value: Any) -> bool:
    """Names to tensors (a module's ``_extra_state`` may be anything)."""
    return (
        isinstance(value, Mapping)
        and any(isinstance(v, torch.Tensor) for v in value.values())
        and all(
            isinstance(k, str) and (isinstance(v, torch.Tensor) or k.endswith("_extra_state")) for k, v in value.items()
        )
    )


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
