"""lightning_twobp: pipeline-parallel training with 2BP, 2-stage backpropagation."""

__version__ = "0.1.0"
