"""The Lightning layer: ``TwoBPStrategy`` and the small modules it delegates to (docs/architecture.md)."""

from lightning_twobp.lightning.strategy import NonFiniteError, Preempted, TwoBPStrategy

__all__ = ["NonFiniteError", "Preempted", "TwoBPStrategy"]
