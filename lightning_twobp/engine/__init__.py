"""The engine: the split backward (:class:`Stage`) and the executor that runs a schedule over stages."""

from lightning_twobp.engine.stage import Stage

__all__ = ["Stage"]
