"""Activation checkpointing under the split: exact, few recomputes, reentrant form refused clearly."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_twobp.engine import Stage
from lightning_twobp.models.llama import Block, LlamaConfig


class Counted(nn.Module):
    """A block that counts its forwards (the recomputes included)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block(LlamaConfig(dim=32, n_heads=4, max_seq_len=16))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.block(x)


class Checkpointed(nn.Module):
    def __init__(self, blocks: list[Counted], reentrant: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.reentrant = reentrant

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.reentrant)
        return x


def test_checkpointed_blocks_are_exact_and_recompute_once_for_b_and_w():
    """Forwards per block per micro-batch: F, one recompute whose tensors W's formulas keep, and B's
    own (was 1 in F + 10 in B on this 3-block stage; a plain backward is 2)."""
    torch.manual_seed(0)
    blocks = [Counted() for _ in range(3)]
    ref = copy.deepcopy(blocks)
    stage = Stage(Checkpointed(blocks))
    xs = [torch.randn(2, 7, 32) for _ in range(2)]
    gs = [torch.randn(2, 7, 32) for _ in range(2)]
    for mb, x in enumerate(xs):
        stage.forward(mb, x.requires_grad_())
    for mb, g in enumerate(gs):
        stage.backward_input(mb, g)
        assert stage._pending[mb].frontier == [], "a weight went back through autograd: W would recompute"
    stage.backward_weight([0, 1])
    assert [b.calls for b in blocks] == [6, 6, 6], "forwards per block over 2 micro-batches"
    for x, g in zip(xs, gs, strict=True):
        y = x.detach()
        for b in ref:
            y = b(y)
        y.backward(g)
    for b, r in zip(blocks, ref, strict=True):
        for (n, q), p in zip(b.named_parameters(), r.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=n)


def test_reentrant_checkpoint_gets_our_message():
    stage = Stage(Checkpointed([Counted()], reentrant=True))
    stage.forward(0, torch.randn(2, 7, 32, requires_grad=True))
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        stage.backward_input(0, torch.ones(2, 7, 32))
