"""Cutting one ``nn.Sequential`` into contiguous stages.

``balance`` chooses the cut: ``"params"`` (default) balances parameter counts, ``"time"`` balances
per-layer costs the caller measured, a list gives the layer count of every stage. Balanced cuts
minimise the largest stage (the pipeline runs at the pace of its slowest stage) by an exact dynamic
program over contiguous splits, where every stage keeps at least one layer.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["balanced_sizes", "even_sizes", "partition", "split_sequential"]


def _check_fits(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"need at least one stage, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(
            f"{num_layers} layers cannot fill {num_stages} stages: lower the number of stages to "
            f"<= {num_layers} or use a model with more layers"
        )


def even_sizes(num_layers: int, num_stages: int) -> list[int]:
    """Layer counts per stage, as even as possible (earlier stages get the remainder)."""
    _check_fits(num_layers, num_stages)
    q, r = divmod(num_layers, num_stages)
    return [q + (1 if i < r else 0) for i in range(num_stages)]


def balanced_sizes(weights: Sequence[float], num_stages: int) -> list[int]:
    """Contiguous layer counts whose largest stage weight is as small as possible; among those,
    the most even (smallest sum of squared stage weights)."""
    n = len(weights)
    _check_fits(n, num_stages)
    if any(w < 0 for w in weights):
        raise ValueError("layer weights must be >= 0")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))

    def solve(cost, cap: float) -> tuple[float, list[int]]:
        """Min over contiguous splits of the combined stage costs, every stage <= cap."""
        inf = float("inf")
        best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
        cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
        best[0][0] = 0.0
        for k in range(1, num_stages + 1):
            for i in range(k, n - (num_stages - k) + 1):
                for j in range(k - 1, i):  # the k-th stage holds layers j..i-1
                    w = prefix[i] - prefix[j]
                    if w > cap or best[k - 1][j] == inf:
                        continue
                    c = cost(best[k - 1][j], w)
                    if c < best[k][i]:
                        best[k][i], cut[k][i] = c, j
        sizes, i = [], n
        for k in range(num_stages, 0, -1):
            sizes.append(i - cut[k][i])
            i = cut[k][i]
        return best[num_stages][n], sizes[::-1]

    largest, _ = solve(max, float("inf"))
    # Second pass: the most even split whose largest stage is still the smallest possible.
    return solve(lambda acc, w: acc + w * w, largest * (1 + 1e-9) + 1e-12)[1]


def partition(
    seq: nn.Sequential,
    num_stages: int,
    balance: str | Sequence[int] = "params",
    costs: Sequence[float] | None = None,
) -> list[int]:
    """Layer counts per stage for ``seq`` (see the module docstring for ``balance``)."""
    n = len(seq)
    if isinstance(balance, str):
        if balance == "params":
            weights = [sum(p.numel() for p in layer.parameters()) for layer in seq]
            return balanced_sizes(weights, num_stages)
        if balance == "time":
            if costs is None or len(costs) != n:
                got = "none" if costs is None else f"{len(costs)}"
                raise ValueError(
                    f'balance="time" needs one measured cost per layer ({n} layers, got {got}): '
                    f"profile the layers first, or use balance='params'"
                )
            return balanced_sizes(costs, num_stages)
        raise ValueError(f"balance must be 'params', 'time' or a list of layer counts, got {balance!r}")
    sizes = [int(s) for s in balance]
    if len(sizes) != num_stages:
        raise ValueError(
            f"balance={sizes} has {len(sizes)} entries for {num_stages} stages: give one layer count per stage"
        )
    if sum(sizes) != n or any(s < 1 for s in sizes):
        raise ValueError(
            f"balance={sizes} sums to {sum(sizes)}, but the Sequential has {n} layers: give every stage "
            f"at least one layer and make the counts sum to {n}"
        )
    return sizes


def split_sequential(seq: nn.Sequential, sizes: Sequence[int]) -> list[nn.Sequential]:
    """Contiguous slices of ``seq`` with ``sizes[i]`` layers each; modules are shared, not copied."""
    if sum(sizes) != len(seq) or any(n < 1 for n in sizes):
        raise ValueError(
            f"stage sizes {list(sizes)} must be positive and sum to the {len(seq)} layers of the Sequential"
        )
    out: list[nn.Sequential] = []
    start = 0
    for n in sizes:
        out.append(seq[start : start + n])  # type: ignore[arg-type]  # a Sequential: torch has no slice overload
        start += n
    return out
