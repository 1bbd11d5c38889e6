"""W by formula (engine/formulas.py) on the layers the 2BP paper's models use: exact against the fused
backward, every parameter through a formula, and B freeing the micro-batch's graph."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_twobp.engine import Stage
from lightning_twobp.models.bert import BertLayer
from lightning_twobp.models.mamba import MambaBlock, MambaConfig
from lightning_twobp.models.resnet import Bottleneck


class ConvBias(nn.Module):
    """A convolution with a bias, a BatchNorm in eval mode and a bias added by broadcast."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4).eval()
        self.shift = nn.Parameter(torch.randn(4, 1, 1))

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)) + self.shift)


class MidEmbedding(nn.Module):
    """An embedding inside a split stage (a position table added to the stage's input)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(8, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        return self.norm(x + self.pos(torch.arange(x.shape[1]).expand(x.shape[0], -1)))


def _mamba():
    return MambaBlock(8, MambaConfig(d_state=4, expand=2, d_conv=3))


CASES = {
    "resnet-bottleneck": (lambda: Bottleneck(16, 4, stride=2), (2, 16, 8, 8)),
    "bert-layer": (lambda: BertLayer(16, 4, 32), (2, 5, 16)),
    "mamba-block": (_mamba, (2, 6, 8)),
    "conv-bias-bn-eval": (ConvBias, (2, 3, 6, 6)),
    "mid-embedding": (MidEmbedding, (2, 5, 6)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_weight_takes_a_formula_and_matches_the_fused_backward(name):
    make, shape = CASES[name]
    torch.manual_seed(0)
    ref = make()
    mod = copy.deepcopy(ref)
    xs = [torch.randn(shape) for _ in range(2)]
    gs = [torch.randn_like(ref(x)) for x in xs]
    ref_in = []
    for x, g in zip(xs, gs, strict=True):
        x = x.clone().requires_grad_()
        ref(x).backward(g)
        ref_in.append(x.grad)

    stage = Stage(mod)
    for mb, x in enumerate(xs):
        stage.forward(mb, x.clone().requires_grad_())
    for mb, g in enumerate(gs):
        (gx,) = stage.backward_input(mb, g)
        torch.testing.assert_close(gx, ref_in[mb], rtol=1e-5, atol=1e-6)
        pending = stage._pending[mb]
        assert pending.frontier == [], f"{[n.name() for n, _ in pending.frontier]} went back through autograd"
        assert pending.outputs == [], "B kept the autograd graph for W"
    assert all(q.grad is None for q in mod.parameters()), "B took weight gradients"
    stage.backward_weight([0, 1])
    assert stage.deferred_fraction == 1.0
    for (n, q), r in zip(mod.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(q.grad, r.grad, rtol=1e-5, atol=1e-6, msg=n)
        assert q.grad.stride() == r.grad.stride(), f"{n}.grad is not laid out like the fused one"
