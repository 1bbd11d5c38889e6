"""Learnable synthetic tasks, one per batch format, so the loss visibly falls in a short run.

Every sample is a function of ``(seed, index)`` alone: two processes (the first and last stage of a
pipeline) that build the same dataset read the same batches, and nothing is precomputed beyond one
number per sample, so ``size`` can be large without the memory.

BERT masking lives here with the masked counting task; ``MaskedLMDataModule`` also applies it to
windows of a token file (``MaskedTokens``).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

__all__ = ["CountingTokens", "MaskedCountingTokens", "MaskedTokens", "SyntheticImages", "bert_mask", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index: positions that are not scored

# Independent random streams per purpose, so e.g. an image's label and its noise never share draws.
_MASK_STREAM, _IMAGE_STREAM = 1, 2


def sample_rng(seed: int, stream: int, index: int) -> np.random.Generator:
    """The generator of sample ``index``: the same in every process, independent across indices."""
    return np.random.default_rng(np.random.SeedSequence([seed, stream, index]))


def _check_index(i: int, size: int) -> int:
    if not -size <= i < size:
        raise IndexError(f"index {i} is out of range for a dataset of {size} samples")
    return i % size


class CountingTokens(Dataset):
    """Sequences that count upwards mod ``vocab_size`` from a random start (token t+1 = token t + 1):
    next-token prediction is learnable in a few dozen steps. Sample i is ``(ids, targets)``, two
    LongTensors of ``seq_len``, targets = ids shifted by one."""

    def __init__(self, vocab_size: int, seq_len: int, size: int, seed: int = 0) -> None:
        if vocab_size < 2 or seq_len < 1 or size < 0:
            raise ValueError(
                f"CountingTokens needs vocab_size >= 2, seq_len >= 1 and size >= 0; got vocab_size {vocab_size}, "
                f"seq_len {seq_len}, size {size}"
            )
        self.vocab_size, self.seq_len = vocab_size, seq_len
        g = torch.Generator().manual_seed(seed)
        # One start per sample (8 bytes each); the sequence itself is computed on access.
        self.starts = torch.randint(0, vocab_size, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = (self.starts[_check_index(i, len(self))] + torch.arange(self.seq_len + 1)) % self.vocab_size
        return t[:-1], t[1:]


def bert_mask(
    ids: torch.Tensor, rng: np.random.Generator, vocab_size: int, mask_token_id: int, mask_prob: float = 0.15
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking of one sequence: ``round(mask_prob * T)`` positions (at least one, so every
    sequence is scored) are chosen; of those 80% become ``mask_token_id``, 10% a random other token
    (never the mask token) and 10% stay. Returns ``(masked ids, labels)``, labels the original token
    at the chosen positions and ``IGNORE_INDEX`` elsewhere."""
    T = ids.shape[-1]
    n = min(T, max(1, round(mask_prob * T)))
    pos = torch.from_numpy(rng.choice(T, size=n, replace=False))
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[pos] = ids[pos]
    out = ids.clone()
    r = rng.random(n)
    to_mask = torch.from_numpy(r < 0.8)
    to_random = torch.from_numpy((r >= 0.8) & (r < 0.9))
    out[pos[to_mask]] = mask_token_id
    # A random token among the vocab_size - 1 that are not the mask token.
    rand = torch.from_numpy(rng.integers(0, vocab_size - 1, size=int(to_random.sum())))
    out[pos[to_random]] = rand + (rand >= mask_token_id).long()
    return out, labels


def _check_mask_args(vocab_size: int, mask_token_id: int, mask_prob: float) -> None:
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(
            f"mask_token_id {mask_token_id} is outside the vocabulary of {vocab_size} ids: use an id in "
            f"[0, {vocab_size}), by default vocab_size - 1 = {vocab_size - 1}"
        )
    if not 0 < mask_prob <= 1:
        raise ValueError(f"mask_prob is {mask_prob}: it must be in (0, 1], BERT uses 0.15")


class _Samples(Protocol):
    """What MaskedTokens reads: a dataset with a length (torch's ``Dataset`` declares none)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> Any: ...


class MaskedTokens(Dataset):
    """BERT masking over any dataset whose samples start with a LongTensor of ids (e.g. a
    ``TokenFile``'s ``(ids, targets)``): sample i is ``(masked ids, labels)``. The masking of sample i
    depends only on ``(seed, i)``: every process masks the same positions, every epoch (static
    masking, as in the original BERT)."""

    def __init__(
        self, base: _Samples, vocab_size: int, seed: int = 0, mask_prob: float = 0.15, mask_token_id: int | None = None
    ) -> None:
        mask_token_id = vocab_size - 1 if mask_token_id is None else mask_token_id
        _check_mask_args(vocab_size, mask_token_id, mask_prob)
        self.base, self.vocab_size, self.seed = base, vocab_size, seed
        self.mask_prob, self.mask_token_id = mask_prob, mask_token_id

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = _check_index(i, len(self))
        sample = self.base[i]
        ids = sample[0] if isinstance(sample, (tuple, list)) else sample
        return bert_mask(
            ids, sample_rng(self.seed, _MASK_STREAM, i), self.vocab_size, self.mask_token_id, self.mask_prob
        )


class _CountingAroundMask(Dataset):
    """Counting sequences over the ``vocab_size - 1`` ids other than the mask token, so a masked
    position is always recoverable from its neighbours (and the mask id never occurs as data)."""

    def __init__(self, vocab_size: int, seq_len: int, size: int, seed: int, mask_token_id: int) -> None:
        self.counting = CountingTokens(vocab_size - 1, seq_len, size, seed)
        self.mask_token_id = mask_token_id

    def __len__(self) -> int:
        return len(self.counting)

    def __getitem__(self, i: int) -> torch.Tensor:
        v = self.counting[i][0]
        return v + (v >= self.mask_token_id).long()  # skip over the mask id


class MaskedCountingTokens(MaskedTokens):
    """The counting task with BERT masking, for masked-LM models: sample i is ``(ids, labels)`` of
    ``seq_len``, labels the original token at ~``mask_prob`` of the positions and -100 elsewhere."""

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        size: int,
        seed: int = 0,
        mask_prob: float = 0.15,
        mask_token_id: int | None = None,
    ) -> None:
        if vocab_size < 3:
            raise ValueError(
                f"MaskedCountingTokens needs vocab_size >= 3 (a mask token and two to count); got {vocab_size}"
            )
        mask_token_id = vocab_size - 1 if mask_token_id is None else mask_token_id
        _check_mask_args(vocab_size, mask_token_id, mask_prob)
        base = _CountingAroundMask(vocab_size, seq_len, size, seed, mask_token_id)
        super().__init__(base, vocab_size, seed, mask_prob, mask_token_id)


class SyntheticImages(Dataset):
    """Class-dependent images: each class is a fixed random low-frequency (4 x 4, upsampled) colour
    pattern, each sample that pattern plus per-pixel noise. A small CNN separates the classes in a
    few dozen steps. Sample i is ``(image float32 (3, H, W), label long ())``. The seed fixes the
    patterns; ``index_offset`` shifts which samples are drawn, so a validation set with the same seed
    and ``index_offset=len(train)`` has the same classes but new samples."""

    PATTERN = 4  # the patterns' resolution before upsampling: low frequency, so pooling keeps them
    NOISE = 0.5  # per-pixel noise std against patterns of std 1

    def __init__(self, num_classes: int, image_size: int, size: int, seed: int = 0, index_offset: int = 0) -> None:
        if num_classes < 1 or image_size < 1 or size < 0:
            raise ValueError(
                f"SyntheticImages needs num_classes >= 1, image_size >= 1 and size >= 0; got num_classes "
                f"{num_classes}, image_size {image_size}, size {size}"
            )
        self.num_classes, self.image_size, self.size, self.seed = num_classes, image_size, size, seed
        self.index_offset = index_offset
        g = torch.Generator().manual_seed(seed)
        # Stored at 4 x 4 (48 floats a class): 1000 classes at full size would be 600 MB at 224 px.
        self.patterns = torch.randn(num_classes, 3, self.PATTERN, self.PATTERN, generator=g)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = sample_rng(self.seed, _IMAGE_STREAM, self.index_offset + _check_index(i, self.size))
        label = int(rng.integers(self.num_classes))
        s = self.image_size
        pattern = F.interpolate(self.patterns[label : label + 1], size=(s, s), mode="bilinear", align_corners=False)[0]
        noise = torch.from_numpy(rng.standard_normal((3, s, s), dtype=np.float32))
        return pattern + self.NOISE * noise, torch.tensor(label)
