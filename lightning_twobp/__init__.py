"""lightning_twobp: pipeline-parallel training with 2BP, 2-stage backpropagation.

Importing the package registers ``strategy="twobp"`` with Lightning (Lightning has no entry-point
discovery for strategies, so a third-party strategy registers itself on import).
"""

from lightning_twobp.lightning import NonFiniteError, TwoBPStrategy
from lightning_twobp.monitor import PipelineMonitor

__version__ = "0.1.0"

__all__ = ["NonFiniteError", "PipelineMonitor", "TwoBPStrategy"]
