"""The engine: the split backward (:class:`Stage`), the executor that runs a schedule over stages, and the
optimizer step's global checks without stopping the pipeline (:class:`StepValidation`)."""

from lightning_twobp.engine.executor import ActionRecord, PipelineError, PipelineExecutor, StepResult
from lightning_twobp.engine.post_validation import StepValidation, Verdict
from lightning_twobp.engine.stage import Stage

__all__ = ["ActionRecord", "PipelineError", "PipelineExecutor", "Stage", "StepResult", "StepValidation", "Verdict"]
