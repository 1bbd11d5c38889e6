"""The engine: the split backward (:class:`Stage`) and the executor that runs a schedule over stages."""

from lightning_twobp.engine.executor import ActionRecord, PipelineError, PipelineExecutor, StepResult
from lightning_twobp.engine.stage import Stage

__all__ = ["ActionRecord", "PipelineError", "PipelineExecutor", "Stage", "StepResult"]
