"""The benchmarks' one workload: a tiny LLaMa-like model, its batch, its cut into stages, its loss.

Every benchmark (engine, Trainer, peer) runs the same thing so their figures compare: 8 blocks x 512
wide, 8 heads, vocabulary 1024, a batch of 32 x 128 tokens split into m micro-batches, on 2 gloo ranks
with one intra-op thread each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightning_twobp.engine.memory import keep_freed_memory
from lightning_twobp.models.llama import LlamaConfig, build_llama
from lightning_twobp.partition import even_sizes, split_sequential

WORLD = 2

__all__ = ["WORLD", "Workload", "keep_freed_memory", "loss_fn", "reference_grads", "stage_sizes"]


@dataclass(frozen=True)
class Workload:
    batch: int = 32
    seq: int = 128
    layers: int = 8
    dim: int = 512
    heads: int = 8
    vocab: int = 1024

    @classmethod
    def quick(cls) -> Workload:
        """A small model, to check a harness end to end in seconds."""
        return cls(batch=8, seq=32, layers=4, dim=64, heads=4, vocab=128)

    @property
    def config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab, dim=self.dim, n_layers=self.layers, n_heads=self.heads, max_seq_len=self.seq
        )

    def model(self) -> nn.Sequential:
        """The model with seed-0 weights: every rank and every contender builds the same one."""
        torch.manual_seed(0)
        return build_llama(self.config)

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch of token ids and next-token targets, the same on every rank."""
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, self.vocab, (self.batch, self.seq), generator=gen)
        return ids, torch.roll(ids, -1, dims=1)

    def stages(self, model: nn.Sequential, num_stages: int) -> list[nn.Sequential]:
        """The model cut into ``num_stages`` contiguous stages (:func:`stage_sizes`)."""
        return split_sequential(model, stage_sizes(self.layers, num_stages))


def stage_sizes(num_blocks: int, num_stages: int) -> list[int]:
    """Layers per stage for embedding + blocks + head: the blocks evenly over the stages, the
    embedding joining the first stage and the head the last. Even layer counts would instead give
    the V's rank 1 five blocks and rank 0 three (the embedding is nearly free)."""
    sizes = even_sizes(num_blocks, num_stages)
    sizes[0] += 1
    sizes[-1] += 1
    return sizes


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def grad_of(q: torch.Tensor) -> torch.Tensor:
    """``q.grad``, which a workload's every parameter has after a backward."""
    assert q.grad is not None, "a parameter took no part in the loss"
    return q.grad


def reference_grads(model: nn.Module, ids: torch.Tensor, tgt: torch.Tensor, m: int) -> dict[str, torch.Tensor]:
    """Gradients of the mean loss over ``m`` micro-batches in one process: what every pipeline must match."""
    model.zero_grad(set_to_none=True)
    for x, y in zip(ids.chunk(m), tgt.chunk(m), strict=False):
        (loss_fn(model(x), y) / m).backward()
    grads = {n: grad_of(q).detach().clone() for n, q in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads
