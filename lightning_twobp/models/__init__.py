"""The 2BP paper's four models, whose layers form one ``nn.Sequential``, and models whose blocks sit in an
``nn.ModuleList`` called in a loop (the two model contracts, docs/strategy.md).

Each is a LightningModule with flat keyword arguments (for Hydra's ``_target_``) and a
``sample_input(batch_size)`` for memory planning; the Sequential ones hold their layers in ``self.layers``.
:class:`HFCausalLM` is Hugging Face's GPT-2 or Llama (``transformers`` is imported when it is built),
:class:`LlamaLoopLM` this package's LLaMa written as a loop over a ModuleList.
"""

from lightning_twobp.models.base import LanguageModel, PipelineModule
from lightning_twobp.models.bert import BertMLM
from lightning_twobp.models.hf import HFCausalLM
from lightning_twobp.models.llama import LlamaConfig, LlamaLM, build_llama
from lightning_twobp.models.llama_loop import LlamaLoop, LlamaLoopLM
from lightning_twobp.models.mamba import MambaLM
from lightning_twobp.models.resnet import ResNetClassifier

__all__ = [
    "BertMLM",
    "HFCausalLM",
    "LanguageModel",
    "LlamaConfig",
    "LlamaLM",
    "LlamaLoop",
    "LlamaLoopLM",
    "MambaLM",
    "PipelineModule",
    "ResNetClassifier",
    "build_llama",
]
