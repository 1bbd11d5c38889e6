"""What a directory of pretrained weights holds, from its headers only: for ``pretrained=``
(:mod:`.pretrained`).

Three kinds, each read through ``torch.distributed.checkpoint``:

* ``"safetensors"``: Hugging Face's (``save_pretrained``, a Hub snapshot), with ``HuggingFaceStorageReader``.
  Where ``model.safetensors.index.json`` is present only the files it lists are read, as
  ``from_pretrained`` reads them (a Hub snapshot may hold another copy of the weights beside them, Mistral's
  ``consolidated.safetensors``, and ``save_pretrained`` leaves an earlier ``model.safetensors`` beside new
  shards); the reader, which takes every ``*.safetensors`` of its folder, is given a folder of links to
  those. Without an index, a key in two files is refused (the reader would take either, tensor by tensor).
* ``"ours"``: a checkpoint directory of this strategy (``meta.pt`` beside DCP's ``.metadata``), its model's
  weights under ``model.``, seen without it.
* ``"dcp"``: another ``torch.distributed.checkpoint`` directory, by its own names.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import weakref
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["FLOATS", "Entry", "Source", "read_headers"]

_OURS = "model."  # this strategy's checkpoints hold the model's weights under it, beside the optimizers' state
_META = "meta.pt"  # lightning.checkpoint.META: what tells this strategy's checkpoint from another DCP one
_INDEX = "model.safetensors.index.json"


# the stored dtypes a float tensor of the model is read from by a cast (safetensors' names and torch's):
# a float8 or integer tensor in their place is a quantized checkpoint, whose values need its scales
_TORCH_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
FLOATS = frozenset({"F64", "F32", "F16", "BF16"} | {str(t) for t in _TORCH_FLOATS})


@dataclass(frozen=True)
class Entry:
    """One stored tensor: the key it is stored under, its shape and its dtype's name."""

    key: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Source:
    """A directory's tensors by the name the model sees each under, and how to read them."""

    path: Path  # the directory the user named
    kind: str  # "safetensors", "ours" or "dcp"
    folder: Path  # the folder the reader reads (for an index, its links to the indexed files)
    entries: dict[str, Entry]

    def reader(self) -> Any:
        if self.kind == "safetensors":
            return dcp.HuggingFaceStorageReader(str(self.folder))
        return dcp.FileSystemReader(self.folder)


def read_headers(path: Path) -> Source:
    """The directory's tensors, from its headers; ValueError naming the file where one cannot be read."""
    if (path / ".metadata").is_file():
        return _dcp(path)
    try:
        import safetensors  # noqa: F401 - the reader imports it inside; named here, before any read
    except ImportError as err:
        raise ImportError(f"pretrained={str(path)!r}: reading safetensors needs pip install safetensors") from err
    files = _indexed(path)
    folder = _linked(files) if (path / _INDEX).is_file() else path
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
