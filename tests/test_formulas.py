"""W by formula (engine/formulas.py) on the layers the 2BP paper's models use: exact against the fused
backward, every parameter through a formula, and B freeing the micro-batch's graph."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_twobp.engine import Stage, formulas
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


class Experts(nn.Module):
    """A mixture of experts as Hugging Face's (5.x) runs one: a router picks 2 of 4 experts per token, the
    tokens sorted by expert go through one grouped matmul per weight (``F.grouped_mm`` with the groups'
    ends), its up weight stored (E, N, K) and used transposed, its down weight stored (E, K, N)."""

    def __init__(self, dim: int = 8, hidden: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, hidden, dim) / dim**0.5)
        self.down = nn.Parameter(torch.randn(experts, hidden, dim) / hidden**0.5)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(self.router(flat).softmax(-1), 2)
        expert = chosen.reshape(-1)
        order = expert.argsort(stable=True)
        token = order // 2
        offs = torch.bincount(expert, minlength=self.up.shape[0]).cumsum(0).to(torch.int32)
        h = torch.nn.functional.grouped_mm(flat[token], self.up.transpose(-1, -2), offs=offs)
        out = torch.nn.functional.grouped_mm(torch.relu(h), self.down, offs=offs)
        out = out * weights.reshape(-1)[order, None]
        return torch.zeros_like(flat).index_add(0, token, out).reshape(x.shape)


class Sliced(nn.Module):
    """Linears on slices of weights: an expert's (E, out, in) weight picked per call, as Hugging Face's
    "eager" experts run them, and rows of a fused weight (W reaches the weight through the slice)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.randn(3, 8, 8) / 8**0.5)
        self.fused = nn.Parameter(torch.randn(24, 8) / 8**0.5)

    def forward(self, x):
        for e in range(3):
            x = torch.relu(nn.functional.linear(x, self.experts[e]))
        return nn.functional.linear(x, self.fused[8:16])


def _mamba():
    return MambaBlock(8, MambaConfig(d_state=4, expand=2, d_conv=3))


CASES = {
    "resnet-bottleneck": (lambda: Bottleneck(16, 4, stride=2), (2, 16, 8, 8)),
    "bert-layer": (lambda: BertLayer(16, 4, 32), (2, 5, 16)),
    "mamba-block": (_mamba, (2, 6, 8)),
    "conv-bias-bn-eval": (ConvBias, (2, 3, 6, 6)),
    "mid-embedding": (MidEmbedding, (2, 5, 6)),
    "moe-experts": (Experts, (2, 5, 8)),
    "sliced-linear": (Sliced, (2, 5, 8)),
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


class PosTable(nn.Module):
    """A position table cut to the micro-batch's length: the weight-only region's shape follows the input."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(8, 6))
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(x + self.pos[: x.shape[1]])


class Scaled(nn.Module):
    """A shift added with ``alpha`` that changes between micro-batches: the same graph shape, a different
    saved flag (alpha 1 has a formula; any other goes back through autograd)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.shift = nn.Parameter(torch.randn(6))
        self.alpha = 1.0

    def forward(self, x):
        return torch.add(self.lin(x), self.shift, alpha=self.alpha)


def _split_vs_fused(make, xs, alphas=None, attr="alpha"):
    """Each micro-batch's F and B in turn, then one W over all; input and parameter grads against the
    fused backward of a copy. ``alphas``: the module's ``attr`` per micro-batch. Returns the stage."""
    torch.manual_seed(0)
    ref = make()
    mod = copy.deepcopy(ref)
    stage = Stage(mod)
    for mb, x in enumerate(xs):
        if alphas is not None:
            setattr(ref, attr, alphas[mb])
            setattr(mod, attr, alphas[mb])
        xr = x.clone().requires_grad_()
        out = ref(xr)
        g = torch.randn_like(out)
        out.backward(g)
        stage.forward(mb, x.clone().requires_grad_())
        (gx,) = stage.backward_input(mb, g)
        torch.testing.assert_close(gx, xr.grad, rtol=1e-5, atol=1e-6)
    stage.backward_weight(list(range(len(xs))))
    for (n, q), r in zip(mod.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(q.grad, r.grad, rtol=1e-5, atol=1e-6, msg=n)
    return stage


def test_training_batch_norm_weights_come_with_b_and_match_the_fused_backward():
    torch.manual_seed(0)
    stage = Stage(Bottleneck(16, 4, stride=2))
    stage.forward(0, torch.randn(2, 16, 8, 8).requires_grad_())
    stage.backward_input(0, torch.randn(2, 16, 4, 4))
    kinds = {f.kind for f, _ in stage._pending[0].fast}
    assert "batch_norm" not in kinds and "conv" in kinds, kinds
    assert len(stage._pending[0].edge_grads) == 8, "each batch norm's scale and bias from B's own call"
    assert all(q.grad is None for q in stage.module.parameters()), "B accumulated weight grads"
    stage.backward_weight(0)
    assert stage.deferred_fraction == 1.0, "a batch norm's free by-products are not counted as taken in B"


def test_a_cached_plan_follows_a_weight_region_shaped_by_the_micro_batch():
    stage = _split_vs_fused(PosTable, [torch.randn(2, 5, 6), torch.randn(2, 3, 6), torch.randn(2, 5, 6)])
    assert len(stage._plans._plans) == 1, "one graph shape, one plan"


def test_a_cached_plan_is_not_reused_when_a_saved_flag_changes():
    stage = _split_vs_fused(Scaled, [torch.randn(4, 6) for _ in range(4)], alphas=[1.0, 2.0, 1.0, 2.0])
    assert len(stage._plans._plans) == 1, "one graph shape: the plan re-made on each change, not added"


class Transposed(nn.Module):
    """An expert weight used transposed in its last two dimensions or in its first two (``dims``, changed
    between micro-batches): the same graph shape, one with the transposed formula and one without."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, 4))
        self.dims = (1, 2)

    def forward(self, x):
        offs = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
        return torch.nn.functional.grouped_mm(x, self.w.transpose(*self.dims), offs=offs)


def test_a_cached_plan_is_not_reused_when_an_expert_weight_is_transposed_otherwise():
    """The cached plan of a grouped matmul keys on the transposed dimensions its formula decided on (it
    reused the (1, 2) formula for a (0, 1) transpose: a gradient 2.4 off)."""
    xs = [torch.randn(4, 4) for _ in range(4)]
    _split_vs_fused(Transposed, xs, alphas=[(1, 2), (0, 1), (1, 2), (0, 1)], attr="dims")


class Routed(nn.Module):
    """Each micro-batch through one of two experts of the same shape (a router's choice): the same node
    kinds and edges, different parameters, so a plan cached for one expert must not serve the other."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.route = 0

    def forward(self, x):
        return torch.relu(self.experts[self.route](x))


class Swapping(nn.Module):
    """Returns an input passed through and a weight-only output, in an order that changes between
    micro-batches: the same graph, but the weight-only output (W's own root) at another position."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(3))
        self.swap = False

    def forward(self, x):
        a, b = self.lin(x), self.scale * 2
        return (a, x, b) if self.swap else (a, b, x)


def test_a_cached_plan_follows_outputs_that_change_places():
    torch.manual_seed(0)
    ref = Swapping()
    mod = copy.deepcopy(ref)
    stage = Stage(mod)
    for mb, swap in enumerate([False, True, False]):
        ref.swap = mod.swap = swap
        x = torch.randn(2, 4)
        outs = ref(x.clone().requires_grad_())
        grads = [torch.randn_like(o) for o in outs]
        torch.autograd.backward(list(outs), grads)
        stage.forward(mb, x.clone().requires_grad_())
        stage.backward_input(mb, grads)
    stage.backward_weight([0, 1, 2])
    for (n, q), r in zip(mod.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(q.grad, r.grad, rtol=1e-5, atol=1e-6, msg=n)
    assert len(stage._plans._plans) == 2, "one plan per output order"


def test_a_cached_plan_is_not_reused_when_the_route_changes():
    stage = _split_vs_fused(Routed, [torch.randn(4, 6) for _ in range(4)], alphas=[0, 1, 1, 0], attr="route")
    assert len(stage._plans._plans) == 2, "one plan per expert"


@pytest.mark.parametrize("name", ["resnet-bottleneck", "bert-layer", "mamba-block"])
@pytest.mark.parametrize("limit", [0, 1 << 30])
def test_batched_w_joins_micro_batches_and_matches_the_fused_backward(name, limit, monkeypatch):
    make, shape = CASES[name]
    joined = []
    real = formulas.batched
    monkeypatch.setattr(formulas, "batched", lambda entries: joined.append(len(entries)) or real(entries))
    torch.manual_seed(0)
    ref = make()
    mod = copy.deepcopy(ref)
    stage = Stage(mod)
    stage.batch_w_bytes = limit
    xs = [torch.randn(shape) for _ in range(3)]
    for mb, x in enumerate(xs):
        out = ref(x.clone().requires_grad_())
        g = torch.randn_like(out)
        out.backward(g)
        stage.forward(mb, x.clone().requires_grad_())
        stage.backward_input(mb, g)
    stage.backward_weight([0, 1, 2])
    assert (set(joined) == {3}) if limit else not joined, joined
    for (n, q), r in zip(mod.named_parameters(), ref.parameters(), strict=True):
        # joined: one sum over three micro-batches, rounded differently from three accumulated sums
        torch.testing.assert_close(q.grad, r.grad, rtol=1e-5, atol=1e-6 * r.grad.abs().max().item(), msg=n)


class CrossAttention(nn.Module):
    """torch's decoder layer attending to a memory made from the same input: its cross-attention splits the
    packed in-projection's bias between the query's product and the key/value's, one weight-only value that
    two Linears use (it ran the whole micro-batch in B, "none deferred to W")."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.layer(x, x.flip(1) * 0.5)


def test_a_weight_value_several_ops_use_is_deferred_by_their_formulas():
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        stage = _split_vs_fused(CrossAttention, [torch.randn(2, 5, 8) for _ in range(3)])
    assert stage.deferred_fraction == 1.0


class SharedWithoutFormula(nn.Module):
    """A weight-only value (``2 w``) that a product with a formula and ``atan2`` (none) both use, ``atan2``
    upstream: W re-entering at ``atan2`` towards that value would run the product's share again."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(8) + 0.5)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        s = self.w * 2
        return torch.atan2(self.lin(x) * s, s)


def test_a_weight_value_an_op_without_a_formula_shares_runs_fused_saying_so_and_stays_exact():
    said = r"MulBackward0 makes feeds 2 ops on the input path, one of them without a W"
    with pytest.warns(RuntimeWarning, match=said):
        stage = _split_vs_fused(SharedWithoutFormula, [torch.randn(4, 8) for _ in range(2)])
    assert stage.deferred_fraction == 0.0


# Shapes a review found (the split crashed in W, or counted a share twice); each now exact, most by falling back.
class CheckpointedUseOfShared(nn.Module):
    """``s`` used by two products (deferred) and, through ``s.exp()``, inside a checkpointed block (carried
    into the weights in B, which freed ``s``'s graph before W's push went through it: a crash)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        s = -self.w.exp()
        y = checkpoint(lambda x, s: x * s.exp(), x, s, use_reentrant=False)
        return y * s + x * s


class NestedAtReentry(nn.Module):
    """``addcmul`` (no formula) of ``s`` and ``-s``: W re-entering it took ``-s``'s share at ``s`` too and
    pushed it again (1.5x the gradient, silently, before the change that split shared values)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        s = self.w * 2
        return torch.addcmul(x, s, s.neg())


class NestedBatchNorm(nn.Module):
    """A training batch norm whose scale is ``s`` and bias ``-s``: B's call took both, one below the other."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        s = self.w * 2
        return nn.functional.batch_norm(x, None, None, s, -s, training=True)


class NestedInCheckpoint(nn.Module):
    """The same nesting inside a checkpointed block, whose edges B takes."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        return checkpoint(self.body, x, self.w, use_reentrant=False)

    @staticmethod
    def body(x, w):
        s = w.exp()
        return torch.addcmul(x, s, -s)


@pytest.mark.parametrize("make", [CheckpointedUseOfShared, NestedAtReentry, NestedBatchNorm, NestedInCheckpoint])
def test_weight_values_taken_twice_or_freed_early_fall_back_exactly(make):
    with pytest.warns(RuntimeWarning, match="none deferred to W"):
        _split_vs_fused(make, [torch.randn(4, 8) for _ in range(2)])


class RootBelowShared(nn.Module):
    """``u = exp(w)`` below a shared ``s = 2 u``, and returned too (an output that reaches no input): W ran that
    output's backward first, freeing ``u``, then pushed the products' shares through it (a crash)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        u = self.w.exp()
        s = u * 2
        return x * s + x.relu() * s, u.sum() * 3


def test_an_output_that_reaches_no_input_below_a_shared_value_keeps_its_graph_for_w():
    torch.manual_seed(0)
    ref = RootBelowShared()
    stage = Stage(copy.deepcopy(ref))
    x, g = torch.randn(4, 8), [torch.randn(4, 8), torch.randn(())]
    xr = x.clone().requires_grad_()
    torch.autograd.backward(list(ref(xr)), g)
    stage.forward(0, x.clone().requires_grad_())
    (gx,) = stage.backward_input(0, g)
    stage.backward_weight(0)
    torch.testing.assert_close(gx, xr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stage.module.w.grad, ref.w.grad, rtol=1e-5, atol=1e-6)
