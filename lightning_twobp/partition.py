"""Cutting one ``nn.Sequential`` into contiguous stages."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["even_sizes", "split_sequential"]


def even_sizes(num_layers: int, num_stages: int) -> list[int]:
    """Layer counts per stage, as even as possible (earlier stages get the remainder)."""
    if num_stages < 1:
        raise ValueError(f"need at least one stage, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(
            f"{num_layers} layers cannot fill {num_stages} stages: lower the number of stages to "
            f"<= {num_layers} or use a model with more layers"
        )
    q, r = divmod(num_layers, num_stages)
    return [q + (1 if i < r else 0) for i in range(num_stages)]


def split_sequential(seq: nn.Sequential, sizes: Sequence[int]) -> list[nn.Sequential]:
    """Contiguous slices of ``seq`` with ``sizes[i]`` layers each; modules are shared, not copied."""
    if sum(sizes) != len(seq) or any(n < 1 for n in sizes):
        raise ValueError(
            f"stage sizes {list(sizes)} must be positive and sum to the {len(seq)} layers of the Sequential"
        )
    out, start = [], 0
    for n in sizes:
        out.append(seq[start : start + n])
        start += n
    return out
