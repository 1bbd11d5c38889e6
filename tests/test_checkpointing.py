"""TwoBPStrategy(activation_checkpointing=...): validated, exact under the split, undone afterwards."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_twobp.engine import Stage
from lightning_twobp.lightning.checkpointing import apply_activation_checkpointing, check_activation_checkpointing
from lightning_twobp.models.llama import Block, LlamaConfig


class Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block(LlamaConfig(dim=32, n_heads=4, max_seq_len=16))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.block(x)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "some", "FULL"])
def test_bad_values_are_refused_naming_the_choices(bad):
    with pytest.raises(ValueError, match=r"None \(off\), 'full'.*every k-th block"):
        check_activation_checkpointing(bad)


def test_selective_is_refused_saying_why():
    with pytest.raises(ValueError, match="selective.*not available yet.*recomputes a block twice"):
        check_activation_checkpointing("selective")


@pytest.mark.parametrize(
    ("value", "calls"),
    [("full", [6, 6, 6]), (2, [6, 2, 6]), (None, [2, 2, 2])],
)
def test_checkpointed_stage_is_exact_and_counts_its_forwards(value, calls):
    """Forwards per block over 2 micro-batches: 3 each when checkpointed (F, W's operands, B), 1 when not."""
    torch.manual_seed(0)
    blocks = [Counted() for _ in range(3)]
    ref = copy.deepcopy(blocks)
    undo = apply_activation_checkpointing(list(enumerate(blocks)), value)
    stage = Stage(nn.Sequential(*blocks))
    xs = [torch.randn(2, 7, 32) for _ in range(2)]
    gs = [torch.randn(2, 7, 32) for _ in range(2)]
    for mb, x in enumerate(xs):
        stage.forward(mb, x.requires_grad_())
    for mb, g in enumerate(gs):
        stage.backward_input(mb, g)
    stage.backward_weight([0, 1])
    assert [b.calls for b in blocks] == calls
    for x, g in zip(xs, gs, strict=True):
        nn.Sequential(*ref)(x.detach()).backward(g)
    for b, r in zip(blocks, ref, strict=True):
        for (n, q), p in zip(b.named_parameters(), r.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=n)
    undo()
    assert all("forward" not in vars(b) for b in blocks), "the blocks were not left as they were found"
