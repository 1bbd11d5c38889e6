"""Models whose layers form one ``nn.Sequential`` (the pipeline contract)."""

from lightning_twobp.models.llama import LlamaConfig, build_llama

__all__ = ["LlamaConfig", "build_llama"]
