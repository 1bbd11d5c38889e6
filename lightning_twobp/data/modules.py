"""LightningDataModules for the paper's model families, with flat arguments for Hydra
(``_target_: lightning_twobp.data.TokenDataModule``, ...). Each uses a learnable synthetic task when
no path is given, local files otherwise; nothing is downloaded.

Train batches are shuffled by torchdata's StatefulDistributedSampler, seeded, over the data-parallel
replicas (one replica in a single process, so one process and one pipeline see the same batches) and
drop the last partial batch, since a pipeline splits every training batch into equal micro-batches.
Validation is unshuffled and keeps its last batch (evaluation takes uneven micro-batches).

The loaders are torchdata's ``StatefulDataLoader``: Lightning saves its position in every
checkpoint, so a run resumed from a mid-epoch checkpoint sees exactly the batches the uninterrupted
run would have (an ordinary ``DataLoader`` restarts the epoch, and Lightning warns it is not
resumable).
"""

from __future__ import annotations

import os
from collections.abc import Sized
from pathlib import Path
from typing import cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import AttributeDict
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from lightning_twobp.data.images import ImageFolder, ImageTensors
from lightning_twobp.data.synthetic import CountingTokens, MaskedCountingTokens, MaskedTokens, SyntheticImages
from lightning_twobp.data.tokens import TokenFile

__all__ = ["ImageDataModule", "MaskedLMDataModule", "TokenDataModule"]


class _DataModule(pl.LightningDataModule):
    """Dataloaders over ``self._build()``'s (train, val) datasets; val may be None (no validation).
    ``train_path`` and ``val_path`` are the subclass's files (None: synthetic data), checked here."""

    def __init__(
        self, batch_size: int, seed: int, num_workers: int, train_path: str | None = None, val_path: str | None = None
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size is {batch_size}: it must be at least 1")
        if val_path is not None and train_path is None:
            raise ValueError(
                f"val_path {val_path} was given without a train path: give both, or neither for synthetic data"
            )
        self.batch_size, self.seed, self.num_workers = batch_size, seed, num_workers
        self._sets: tuple[Dataset, Dataset | None] | None = None

    def _build(self) -> tuple[Dataset, Dataset | None]:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self._sets is None:
            self._sets = self._build()

    @property
    def train_set(self) -> Dataset:
        self.setup()
        assert self._sets is not None  # setup() built them
        return self._sets[0]

    @property
    def val_set(self) -> Dataset | None:
        self.setup()
        assert self._sets is not None  # setup() built them
        return self._sets[1]

    def _replicas(self) -> dict[str, int] | None:
        """The strategy's data-parallel split (``num_replicas``, ``rank``) under a distributed run."""
        trainer = getattr(self, "_trainer", None) or getattr(self, "trainer", None)
        strategy = getattr(trainer, "strategy", None)
        if strategy is None or getattr(strategy, "world_size", 1) <= 1:
            return None
        return getattr(strategy, "distributed_sampler_kwargs", None)

    def _loader(self, ds: Dataset, train: bool) -> StatefulDataLoader:
        # Under a distributed run the training sampler is torchdata's StatefulDistributedSampler, made
        # here: Lightning leaves a DistributedSampler alone, whereas the one it would inject itself sits
        # inside a rebuilt batch sampler whose position a resume does not restore (measured: another
        # order of batches after resuming mid-epoch).
        # One process uses the same sampler as one replica, so a pipeline sees the batches one process does.
        sampler = None
        if train:
            replicas = self._replicas() or {"num_replicas": 1, "rank": 0}
            sampler = StatefulDistributedSampler(ds, shuffle=True, seed=self.seed, **replicas)
        return StatefulDataLoader(
            ds,
            batch_size=self.batch_size,
            shuffle=train and sampler is None,
            sampler=sampler,
            drop_last=train,
            generator=torch.Generator().manual_seed(self.seed) if train and sampler is None else None,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> StatefulDataLoader:
        ds = self.train_set
        assert isinstance(ds, Sized)  # every set _build() makes has a length
        if len(ds) < self.batch_size:
            raise ValueError(
                f"the training set holds {len(ds):,} samples, fewer than one batch of {self.batch_size} (the last "
                f"partial batch is dropped): lower batch_size or give more data"
            )
        return self._loader(ds, train=True)

    def val_dataloader(self) -> StatefulDataLoader | list:
        ds = self.val_set
        return [] if ds is None else self._loader(ds, train=False)  # []: Lightning skips validation


class _TokenDataModule(_DataModule):
    """Token windows: synthetic sets without ``train_path`` (``num_train`` and ``num_val`` samples), else
    the token files, each checked against ``vocab_size``. A subclass says what one set of either is."""

    def _synthetic(self, size: int, seed: int) -> Dataset:
        raise NotImplementedError

    def _file(self, path: str, split: int) -> Dataset:
        """The set of token file ``path`` (``split``: 0 for train, 1 for validation)."""
        raise NotImplementedError

    def _build(self) -> tuple[Dataset, Dataset | None]:
        h = cast(AttributeDict, self.hparams)  # save_hyperparameters() stores an AttributeDict
        if h.train_path is None:
            # The validation set draws its own starts (seed + 1): it measures, rather than repeats, training.
            return self._synthetic(h.num_train, h.seed), (self._synthetic(h.num_val, h.seed + 1) if h.num_val else None)
        return self._file(h.train_path, 0), (None if h.val_path is None else self._file(h.val_path, 1))

    def _token_file(self, path: str) -> TokenFile:
        h = cast(AttributeDict, self.hparams)
        return TokenFile(path, h.seq_len, h.dtype, h.vocab_size)


class TokenDataModule(_TokenDataModule):
    """Next-token prediction (LLaMa, Mamba): batches ``(ids (B, T), targets (B, T))``, targets the
    ids shifted by one. Synthetic counting sequences without ``train_path``; token files (see
    ``twobp-tokenize``) with it, checked against ``vocab_size``. ``num_train`` / ``num_val`` size
    the synthetic sets only."""

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        batch_size: int,
        train_path: str | None = None,
        val_path: str | None = None,
        num_train: int = 4096,
        num_val: int = 256,
        seed: int = 0,
        num_workers: int = 0,
        dtype: str | None = None,
    ) -> None:
        super().__init__(batch_size, seed, num_workers, train_path, val_path)
        self.save_hyperparameters()

    def _synthetic(self, size: int, seed: int) -> Dataset:
        h = cast(AttributeDict, self.hparams)
        return CountingTokens(h.vocab_size, h.seq_len, size, seed)

    def _file(self, path: str, split: int) -> Dataset:
        return self._token_file(path)


class MaskedLMDataModule(_TokenDataModule):
    """Masked-LM (BERT): batches ``(ids (B, T), labels (B, T))``, ~``mask_prob`` of the positions
    masked BERT's way and scored (labels -100 elsewhere). Synthetic masked counting without
    ``train_path``; windows of token files, masked on the fly, with it. The mask token defaults to
    ``vocab_size - 1``: for token files it must be an id the tokenizer never emits (the byte
    tokenizer leaves 257..383 free)."""

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        batch_size: int,
        train_path: str | None = None,
        val_path: str | None = None,
        num_train: int = 4096,
        num_val: int = 256,
        seed: int = 0,
        num_workers: int = 0,
        mask_prob: float = 0.15,
        mask_token_id: int | None = None,
        dtype: str | None = None,
    ) -> None:
        super().__init__(batch_size, seed, num_workers, train_path, val_path)
        self.save_hyperparameters()

    def _synthetic(self, size: int, seed: int) -> Dataset:
        h = cast(AttributeDict, self.hparams)
        return MaskedCountingTokens(h.vocab_size, h.seq_len, size, seed, h.mask_prob, h.mask_token_id)

    def _file(self, path: str, split: int) -> Dataset:
        h = cast(AttributeDict, self.hparams)
        f = self._token_file(path)
        mask_id = h.vocab_size - 1 if h.mask_token_id is None else h.mask_token_id
        if mask_id == f.meta.get("eot_id"):
            raise ValueError(
                f"mask_token_id {mask_id} is {Path(path).name}'s end-of-text id: pick an id the tokenizer never emits"
            )
        return MaskedTokens(f, h.vocab_size, h.seed + split, h.mask_prob, h.mask_token_id)


class ImageDataModule(_DataModule):
    """Image classification (ResNet): batches ``(images float32 (B, 3, H, W), labels long (B,))``.
    ``path`` (and ``val_path``) choose the source: None for synthetic class patterns, a directory for
    an ``ImageFolder`` (one subdirectory per class), a ``.pt`` file for ``ImageTensors``."""

    def __init__(
        self,
        num_classes: int,
        image_size: int,
        batch_size: int,
        path: str | None = None,
        val_path: str | None = None,
        num_train: int = 2048,
        num_val: int = 256,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, seed, num_workers, path, val_path)
        self.save_hyperparameters()

    def _open(self, p: str | os.PathLike) -> Dataset:
        h, path = cast(AttributeDict, self.hparams), Path(p)
        if path.is_dir():
            ds = ImageFolder(path, h.image_size)
            if len(ds.classes) > h.num_classes:
                raise ValueError(
                    f"image folder {path} has {len(ds.classes)} classes but num_classes is {h.num_classes}: "
                    f"set num_classes={len(ds.classes)}"
                )
            return ds
        if path.suffix == ".pt" or path.is_file():
            return ImageTensors(path, h.image_size, h.num_classes)  # a missing .pt file is reported there
        raise FileNotFoundError(
            f"image path {path} does not exist: give a directory with one subdirectory per class, or a .pt file "
            f"of {{'images', 'labels'}} tensors"
        )

    def _build(self) -> tuple[Dataset, Dataset | None]:
        h = cast(AttributeDict, self.hparams)  # save_hyperparameters() stores an AttributeDict
        if h.path is None:
            # Validation shares the seed (so the class patterns) and takes the samples after training's.
            return (
                SyntheticImages(h.num_classes, h.image_size, h.num_train, h.seed),
                SyntheticImages(h.num_classes, h.image_size, h.num_val, h.seed, index_offset=h.num_train)
                if h.num_val
                else None,
            )
        train = self._open(h.path)
        val = self._open(h.val_path) if h.val_path is not None else None
        if isinstance(train, ImageFolder) and isinstance(val, ImageFolder) and val.classes != train.classes:
            only_train = sorted(set(train.classes) - set(val.classes))
            only_val = sorted(set(val.classes) - set(train.classes))
            raise ValueError(
                f"the train and val folders name different classes (train only: {only_train}, val only: "
                f"{only_val}), so their labels would not match: give both folders the same class subdirectories"
            )
        return train, val
