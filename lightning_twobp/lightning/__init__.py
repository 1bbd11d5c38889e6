"""The Lightning layer: ``TwoBPStrategy`` and the small modules it delegates to (docs/architecture.md)."""

from lightning_twobp.lightning.strategy import HookScaleError, NonFiniteError, Preempted, TwoBPStrategy

__all__ = ["HookScaleError", "NonFiniteError", "Preempted", "TwoBPStrategy"]
