"""Token files in nanoGPT's layout, and a byte-level tokenizer that needs no download.

    twobp-tokenize INPUT... --out DIR [--val-fraction 0.05]

writes ``DIR/train.bin`` and ``DIR/val.bin``: the files' bytes as one flat stream of uint16 token ids
(each file followed by an end-of-text token), the last ``val-fraction`` of the stream going to
validation, each with a JSON sidecar ``<file>.json`` giving its dtype, vocab_size, num_tokens and
tokenizer. ``TokenFile`` reads such a file (or any flat uint16/uint32 array of token ids) through a
memory map, as non-overlapping windows of ``seq_len`` inputs and their next-token targets.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = [
    "BYTE_VOCAB_SIZE",
    "EOT_ID",
    "TokenFile",
    "decode_bytes",
    "encode_bytes",
    "main",
    "read_sidecar",
    "tokenize_files",
]

log = logging.getLogger(__name__)

# Byte-level tokenizer: ids 0..255 are the bytes, 256 ends a document. That needs 257 ids; the
# vocabulary is padded to 384 = 3 x 128 because an embedding / output layer whose size is a multiple
# of 64-128 runs markedly faster on GPUs (nanoGPT pads GPT-2's 50257 to 50304 for the same reason).
# Ids 257..383 never occur in the data, so vocab_size - 1 = 383 is free to be BERT's mask token.
EOT_ID = 256
BYTE_VOCAB_SIZE = 384
_TOKENIZER = "bytes"
_DTYPES = ("uint16", "uint32")
_CHUNK = 1 << 24  # bytes read at a time while tokenizing: memory stays flat for any file size


def encode_bytes(data: bytes) -> np.ndarray:
    """The byte tokenizer: one uint16 id per byte (no end-of-text token added)."""
    return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)


def decode_bytes(ids) -> str:
    """Text from byte-tokenizer ids: end-of-text shows as ``<|endoftext|>`` (as in GPT-2's
    tokenizer), ids that are not bytes as U+FFFD, and bytes that are not valid UTF-8 (a window can
    start inside a character) are replaced."""
    out = bytearray()
    for t in np.asarray(ids).reshape(-1).tolist():
        if t < 256:
            out.append(t)
        elif t == EOT_ID:
            out += b"<|endoftext|>"
        else:
            out += "\ufffd".encode()
    return out.decode("utf-8", errors="replace")


def sidecar_path(path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(path)}.json")


def read_sidecar(path: str | os.PathLike) -> dict | None:
    """The metadata written next to a token file (``<path>.json``), or None if there is none."""
    side = sidecar_path(path)
    if not side.is_file():
        return None
    try:
        meta = json.loads(side.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{side} is not readable JSON ({e}): delete it and pass dtype=, or re-run twobp-tokenize"
        ) from e
    if not isinstance(meta, dict):
        raise ValueError(f"{side} holds a {type(meta).__name__}, not a JSON object: re-run twobp-tokenize")
    return meta


def _write_sidecar(path: Path, num_tokens: int) -> None:
    meta = {
        "dtype": "uint16",
        "vocab_size": BYTE_VOCAB_SIZE,
        "num_tokens": num_tokens,
        "tokenizer": _TOKENIZER,
        "eot_id": EOT_ID,
    }
    sidecar_path(path).write_text(json.dumps(meta, indent=2) + "\n")


def _resolve_dtype(path: Path, dtype, meta: dict | None) -> np.dtype:
    if dtype is None:
        if meta is None or "dtype" not in meta:
            raise ValueError(
                f"{path} has no sidecar {sidecar_path(path).name} saying its dtype: pass dtype='uint16' or "
                f"dtype='uint32' (whichever it was written with), or write it with twobp-tokenize"
            )
        dtype = meta["dtype"]
    elif meta is not None and "dtype" in meta and np.dtype(meta["dtype"]) != np.dtype(dtype):
        raise ValueError(
            f"dtype={np.dtype(dtype).name} was passed but {sidecar_path(path).name} says {path.name} holds "
            f"{meta['dtype']}: drop the dtype argument or correct the sidecar"
        )
    try:
        resolved = np.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"{dtype!r} is not a numpy dtype: token files are {' or '.join(_DTYPES)}") from e
    if resolved.name not in _DTYPES:
        raise ValueError(f"{path} would be read as {resolved.name}: token files are {' or '.join(_DTYPES)}")
    return resolved


class TokenFile(Dataset):
    """Non-overlapping windows of a flat binary file of token ids (nanoGPT's ``train.bin``).

    Sample i is ``(ids, targets)``: tokens ``[i*seq_len, (i+1)*seq_len)`` and the same shifted by one,
    as int64 tensors. The dtype comes from the sidecar ``<path>.json`` or the ``dtype`` argument.
    With ``vocab_size`` (the model's), the file is checked to hold no id the model cannot embed: by
    the sidecar's vocab_size, or by scanning the file when it has no sidecar.
    """

    def __init__(self, path: str | os.PathLike, seq_len: int, dtype=None, vocab_size: int | None = None) -> None:
        path = Path(path)
        if seq_len < 1:
            raise ValueError(f"seq_len is {seq_len}: it must be at least 1")
        if not path.is_file():
            raise FileNotFoundError(
                f"token file {path} does not exist: write one with `twobp-tokenize TEXT... --out DIR` "
                f"(DIR/train.bin, DIR/val.bin) or check the path"
            )
        meta = read_sidecar(path)
        self.path, self.seq_len, self.meta = path, seq_len, meta or {}
        self._mm: np.memmap | None = None
        self.dtype = _resolve_dtype(path, dtype, meta)
        nbytes, item = path.stat().st_size, self.dtype.itemsize
        if nbytes % item:
            raise ValueError(
                f"{path} is {nbytes:,} bytes, not a multiple of {item} ({self.dtype.name}'s item size): it is "
                f"truncated or was not written as {self.dtype.name}; pass the dtype it was written with"
            )
        self.num_tokens = nbytes // item
        if meta is not None and meta.get("num_tokens", self.num_tokens) != self.num_tokens:
            raise ValueError(
                f"{sidecar_path(path).name} says {meta['num_tokens']:,} tokens but {path} holds {self.num_tokens:,} "
                f"{self.dtype.name}s: the file was truncated or rewritten; re-run twobp-tokenize"
            )
        if self.num_tokens < seq_len + 1:
            raise ValueError(
                f"{path.name} holds {self.num_tokens:,} tokens, too short for seq_len {seq_len} + 1: use a "
                f"shorter seq_len or more text"
            )
        if vocab_size is not None:
            self._check_vocab(vocab_size)

    def _check_vocab(self, vocab_size: int) -> None:
        if "vocab_size" in self.meta:
            if self.meta["vocab_size"] > vocab_size:
                raise ValueError(
                    f"{self.path.name} was written for vocab_size {self.meta['vocab_size']:,} (tokenizer "
                    f"{self.meta.get('tokenizer', 'unknown')}) but the model's vocab_size is {vocab_size:,}: set "
                    f"vocab_size >= {self.meta['vocab_size']:,}"
                )
            return
        # No sidecar to trust: one pass over the file, in chunks so memory stays flat.
        data, top = self._data(), 0
        for start in range(0, self.num_tokens, _CHUNK):
            top = max(top, int(data[start : start + _CHUNK].max()))
        if top >= vocab_size:
            raise ValueError(
                f"{self.path.name} holds token id {top:,}, outside the model's vocab_size {vocab_size:,}: set "
                f"vocab_size >= {top + 1:,} or re-tokenize with a smaller vocabulary"
            )

    def _data(self) -> np.memmap:
        # Opened on first use in each process (a DataLoader worker maps the file itself rather than
        # receiving a pickled copy of it).
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._mm

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_mm": None}

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"window {i} is out of range: {self.path.name} has {n} windows of seq_len {self.seq_len}")
        start = (i % n) * self.seq_len
        w = torch.from_numpy(self._data()[start : start + self.seq_len + 1].astype(np.int64))
        return w[:-1], w[1:]


def tokenize_files(inputs: list[str | os.PathLike], out_dir: str | os.PathLike, val_fraction: float = 0.05) -> dict:
    """Byte-tokenize ``inputs`` into ``out_dir/train.bin`` and ``out_dir/val.bin`` (+ sidecars).
    Returns ``{"train": n, "val": n, "files": n}`` token counts. ``val.bin`` is written only when
    ``val_fraction > 0``."""
    if not inputs:
        raise ValueError("no input files: pass one or more text files to tokenize")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction is {val_fraction}: it must be in [0, 1), e.g. 0.05")
    paths = [Path(p) for p in inputs]
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"input {p} is not a file: pass text files (a directory's files: DIR/*.txt)")
    # Byte-level: exactly one token per byte plus one end-of-text per file, known before reading.
    total = sum(p.stat().st_size + 1 for p in paths)
    n_val = max(1, round(total * val_fraction)) if val_fraction > 0 else 0
    n_train = total - n_val
    if n_train < 2:
        raise ValueError(f"the inputs hold {total:,} tokens, {n_train} left for training: give more text")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_path, val_path = out / "train.bin", out / "val.bin"
    written = 0
    with open(train_path, "wb") as train, open(val_path, "wb") if n_val else open(os.devnull, "wb") as val:

        def emit(ids: np.ndarray) -> None:
            nonlocal written
            k = max(0, min(len(ids), n_train - written))  # what still belongs to train
            ids[:k].tofile(train)
            ids[k:].tofile(val)
            written += len(ids)

        for p in paths:
            with open(p, "rb") as f:
                while chunk := f.read(_CHUNK):
                    emit(encode_bytes(chunk))
            emit(np.array([EOT_ID], dtype=np.uint16))
            log.debug("tokenized %s", p)
    if written != total:  # a file changed size while being read
        raise RuntimeError(
            f"expected {total:,} tokens but wrote {written:,}: an input changed while tokenizing; re-run"
        )
    _write_sidecar(train_path, n_train)
    if n_val:
        _write_sidecar(val_path, n_val)
    else:  # a val.bin from an earlier run would no longer match this train.bin
        for stale in (val_path, sidecar_path(val_path)):
            if stale.exists():
                log.info("removing %s from an earlier run (--val-fraction 0 writes no val.bin)", stale)
                stale.unlink()
    return {"train": n_train, "val": n_val, "files": len(paths)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="twobp-tokenize", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("inputs", nargs="+", metavar="INPUT", help="text files (any encoding: they are read as bytes)")
    ap.add_argument(
        "--out", required=True, metavar="DIR", help="directory for train.bin, val.bin and their .json sidecars"
    )
    ap.add_argument("--val-fraction", type=float, default=0.05, help="share of the tokens for val.bin (0: none)")
    args = ap.parse_args(argv)
    try:
        n = tokenize_files(args.inputs, args.out, args.val_fraction)
    except (ValueError, OSError) as e:  # bad inputs, or an --out that cannot be a directory
        ap.error(str(e))
    out = Path(args.out)
    val = f", {out / 'val.bin'} ({n['val']:,})" if n["val"] else ""
    print(
        f"wrote {n['train'] + n['val']:,} tokens from {n['files']} file(s): {out / 'train.bin'} "
        f"({n['train']:,}){val}; byte tokenizer, vocab_size {BYTE_VOCAB_SIZE}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
