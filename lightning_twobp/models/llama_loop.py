"""The LLaMa of :mod:`lightning_twobp.models.llama` written as most models are: blocks in an ``nn.ModuleList``
that the model's forward calls in a loop, with side inputs made once before it.

    x = self.embed(ids)                     # (B, T, C)
    cos, sin = self.rotary(x)               # side inputs: rotary tables for T positions
    for block in self.blocks:
        x = block(x, cos=cos, sin=sin)
    return self.head(x)                     # (B, T, V)

``strategy="twobp"`` pipelines it through the ModuleList contract (``layers="model.blocks"``, or found
on its own). Built from the same seed it has exactly the weights of :func:`~lightning_twobp.models.llama.build_llama`
(the same modules, created in the same order), and it computes the same function, so the two forms
can be compared step for step (``lightning_twobp.bench.modulelist``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightning_twobp.models.llama import Block, Embedding, Head, LlamaConfig, LlamaLM, copy_rope_tables, rope_tables_of

__all__ = ["LlamaLoop", "LlamaLoopLM"]


class Rotary(nn.Module):
    """The rotary cos/sin tables (buffers, no parameters), sliced to the sequence length."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        cos, sin = rope_tables_of(cfg)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def reset_parameters(self) -> None:  # the tables again: a meta build has none
        copy_rope_tables(self, self.cfg)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (B, T, C) -> 2 x (T, D/2)
        t = x.shape[1]
        return self.cos[:t], self.sin[:t]


class LlamaLoop(nn.Module):
    """Embedding, ``n_layers`` blocks in ``self.blocks`` (an ``nn.ModuleList``), norm + head."""

    def __init__(self, cfg: LlamaConfig = LlamaConfig()) -> None:
        super().__init__()
        self.embed = Embedding(cfg.vocab_size, cfg.dim)
        self.rotary = Rotary(cfg)
        self.blocks = nn.ModuleList(Block(cfg, rope_tables=False) for _ in range(cfg.n_layers))
        self.head = Head(cfg)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        x = self.embed(ids)
        cos, sin = self.rotary(x)
        for block in self.blocks:
            x = block(x, cos=cos, sin=sin)
        return self.head(x)


class LlamaLoopLM(LlamaLM):
    """:class:`~lightning_twobp.models.llama.LlamaLM` with the model in the loop form (``self.model``)."""

    @override
    def _build(self) -> None:
        self.model = LlamaLoop(self.config)  # from the same seeded RNG: the Sequential form's weights

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    @override
    def model_output(self, batch: Any) -> torch.Tensor:
        return self.model(batch[0])
