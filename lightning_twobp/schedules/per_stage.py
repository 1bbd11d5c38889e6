"""Per-stage values of the schedule model (durations in :class:`~.simulate.Costs`, bytes in
:class:`~.memory.MemoryCosts`): a number for every stage, or one number per stage."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PerStage", "check_stage_count", "stage_value", "store_per_stage"]

PerStage = float | Sequence[float]


def store_per_stage(obj: object, owner: str, names: Sequence[str]) -> None:
    """Check the fields ``names`` of the frozen dataclass ``obj`` (numbers >= 0) and store sequences as
    tuples of floats, so that ``obj`` stays hashable."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, (int, float)):
            values: tuple[float, ...] = (float(value),)
        else:
            values = tuple(float(v) for v in value)
            if not values:
                raise ValueError(f"{owner}.{name} needs at least one value")
            object.__setattr__(obj, name, values)
        if any(v < 0 for v in values):
            raise ValueError(f"{owner}.{name} must be >= 0, got {value!r}")


def check_stage_count(obj: object, owner: str, names: Sequence[str], num_stages: int) -> None:
    """Raise ValueError when a per-stage sequence does not have one value per stage."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, tuple) and len(value) != num_stages:
            raise ValueError(f"{owner}.{name} has {len(value)} values for {num_stages} stages")


def stage_value(value: PerStage, stage: int) -> float:
    return value[stage] if isinstance(value, tuple) else value  # type: ignore[return-value]
