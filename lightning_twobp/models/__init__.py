"""Models whose layers form one ``nn.Sequential`` (the pipeline contract): the 2BP paper's four.

Each is a LightningModule with flat keyword arguments (for Hydra's ``_target_``), its layers in
``self.layers`` and a ``sample_input(batch_size)`` for memory planning.
"""

from lightning_twobp.models.base import PipelineModule
from lightning_twobp.models.bert import BertMLM
from lightning_twobp.models.llama import LlamaConfig, LlamaLM, build_llama
from lightning_twobp.models.mamba import MambaLM
from lightning_twobp.models.resnet import ResNetClassifier

__all__ = ["BertMLM", "LlamaConfig", "LlamaLM", "MambaLM", "PipelineModule", "ResNetClassifier", "build_llama"]
