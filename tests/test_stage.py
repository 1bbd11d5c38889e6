"""The split backward against ``loss.backward()`` on a zoo of modules.

Each case builds a module and inputs; the reference runs forward + ``backward`` on the whole thing, the
Stage runs F, then B (its input grads are compared with the reference's), then W (every ``.grad`` is
compared). Micro-batches interleave (F0 F1 B0 B1 W(0,1)) so per-micro-batch state is exercised.
"""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_twobp.engine import Stage
from lightning_twobp.models.llama import Block, LlamaConfig

RTOL, ATOL = 1e-5, 1e-6


class Twice(nn.Module):
    """The same Linear applied twice: one parameter, two uses."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


class TiedT(nn.Module):
    """One weight transposed once and used by two matmuls on the same path."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, x):
        wt = self.w.t()
        return torch.tanh(x @ wt) @ wt


class DirectTwice(nn.Module):
    """A parameter used directly (no transpose) by two elementwise ops."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(8))
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x * self.scale) * self.scale


class Square(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        Square.calls += 1
        (x,) = ctx.saved_tensors
        return 2 * x * g


class WithCustomFn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(Square.apply(self.a(x)))


class MultiIO(nn.Module):
    """Several tensor inputs, a non-tensor passed through, several outputs, a view, an unused param."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x, y, k, mask):
        h = self.a(x) * k + self.frozen(y)
        return h[:, :4], self.b(h).transpose(0, 1), mask


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.gn = nn.GroupNorm(2, 4)

    def forward(self, x):
        return self.gn(self.c2(F.relu(self.bn(self.c1(x)))))


class EmbedLN(nn.Module):
    """A first stage: token ids (no grad) -> embedding -> LayerNorm -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.ln = nn.LayerNorm(8)
        self.lin = nn.Linear(8, 8)

    def forward(self, ids):
        return self.lin(self.ln(self.emb(ids)))


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.o = nn.Linear(8, 8)

    def forward(self, x):  # (B, T, C)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        shape = (x.shape[0], x.shape[1], 2, 4)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(x.shape))


class WeightOnlyOutput(nn.Module):
    """One output never touches the input: its backward reaches only a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.p = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return self.lin(x), self.p * 2, self.p


class SameShapeBias(nn.Module):
    """``x + b`` with ``b`` shaped like ``x``: autograd hands back the very grad tensor it got."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.randn(1, 8))

    def forward(self, x):
        return x + self.b


class BroadcastGrad(nn.Module):
    """``x * p.sum()``: p's gradient is a stride-0 expansion."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(8))
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * self.p.sum()


class MidEmbeddingTied(nn.Module):
    """An embedding in the middle of a stage whose weight is also the output head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)

    def forward(self, x, ids):
        h = self.emb(ids) + x
        return h @ self.emb.weight.t()


class FirstOutput(nn.Module):
    """A recurrent layer or attention that returns a tuple: its first output only."""

    def __init__(self, module: nn.Module, **call: bool) -> None:
        super().__init__()
        self.m, self.call = module, call

    def forward(self, x):
        return self.m(x, x, x, **self.call)[0] if isinstance(self.m, nn.MultiheadAttention) else self.m(x)[0]


class LoRA(nn.Module):
    """A frozen base Linear with a trainable low-rank update (LoRA's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 8).requires_grad_(False)
        self.a, self.b = nn.Linear(8, 2, bias=False), nn.Linear(2, 8, bias=False)

    def forward(self, x):
        return self.base(x) + 0.5 * self.b(self.a(x))


class Einsum(nn.Module):
    """A 3-d weight used by einsum, and one by bmm: weights that are no Linear's."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 8, 4))
        self.v = nn.Parameter(torch.randn(2, 8, 8))

    def forward(self, x):
        return torch.bmm(torch.einsum("bsd,hde->bshe", x, self.w).flatten(-2), self.v)


def _x(*shape):
    return torch.randn(*shape, requires_grad=True)


def _seq(*shape):
    return lambda: (_x(*shape),)


CASES = {
    "linear": (lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), lambda: (_x(4, 8),)),
    "no-bias": (lambda: nn.Linear(8, 8, bias=False), lambda: (_x(3, 5, 8),)),
    "twice": (Twice, lambda: (_x(4, 8),)),
    "tied-transpose": (TiedT, lambda: (_x(4, 8),)),
    "direct-twice": (DirectTwice, lambda: (_x(4, 8),)),
    "custom-fn": (WithCustomFn, lambda: (_x(4, 8),)),
    "multi-io": (MultiIO, lambda: (_x(4, 8), _x(4, 8), 0.5, torch.ones(2, dtype=torch.bool))),
    "conv-norms": (ConvNet, lambda: (_x(2, 3, 6, 6),)),
    "embedding-first": (EmbedLN, lambda: (torch.randint(0, 16, (2, 5)),)),
    "sdpa": (Attn, lambda: (_x(2, 6, 8),)),
    "weight-only-output": (WeightOnlyOutput, lambda: (_x(4, 8),)),
    "same-shape-bias": (SameShapeBias, lambda: (_x(1, 8),)),
    "broadcast-grad": (BroadcastGrad, lambda: (_x(4, 8),)),
    "mid-embedding-tied": (MidEmbeddingTied, lambda: (_x(2, 5, 8), torch.randint(0, 16, (2, 5)))),
    "llama-block": (
        lambda: Block(LlamaConfig(dim=32, n_heads=4, n_kv_heads=2, max_seq_len=16)),
        lambda: (_x(2, 7, 32),),
    ),
    # torch's own layers, as users' models hold them
    "lstm": (lambda: FirstOutput(nn.LSTM(8, 8, num_layers=2, bidirectional=True, batch_first=True)), _seq(2, 5, 8)),
    "gru": (lambda: FirstOutput(nn.GRU(8, 8, batch_first=True)), _seq(2, 5, 8)),
    "rnn": (lambda: FirstOutput(nn.RNN(8, 8, batch_first=True)), _seq(2, 5, 8)),
    "mha": (lambda: FirstOutput(nn.MultiheadAttention(8, 2, batch_first=True), need_weights=False), _seq(2, 5, 8)),
    "mha-weights": (lambda: FirstOutput(nn.MultiheadAttention(8, 2, batch_first=True)), _seq(2, 5, 8)),
    "encoder-layer": (
        lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=True),
        _seq(2, 5, 8),
    ),
    "conv1d-glu": (lambda: nn.Sequential(nn.Conv1d(4, 8, 3, padding=1), nn.GLU(1)), _seq(2, 4, 10)),
    "conv3d": (lambda: nn.Conv3d(2, 3, 3), _seq(1, 2, 5, 5, 5)),
    "conv-transpose": (lambda: nn.ConvTranspose2d(4, 3, 3, stride=2), _seq(2, 4, 5, 5)),
    "conv-depthwise-circular": (
        lambda: nn.Sequential(nn.Conv2d(4, 4, 3, groups=4, padding=1, padding_mode="circular"), nn.PReLU()),
        _seq(2, 4, 6, 6),
    ),
    "instance-group-norm": (
        lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4, affine=True), nn.GroupNorm(2, 4)),
        _seq(2, 3, 6, 6),
    ),
    "weight-norm": (lambda: nn.utils.parametrizations.weight_norm(nn.Linear(8, 8)), _seq(4, 8)),
    "rms-norm": (lambda: nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8), nn.LayerNorm(8, bias=False)), _seq(4, 8)),
    "lora": (LoRA, _seq(4, 8)),
    "einsum-bmm": (Einsum, _seq(2, 5, 8)),
}


def _tensor_outputs(out):
    out = out if isinstance(out, tuple) else (out,)
    return [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]


def _reference(module, inputs_per_mb, grads_per_mb):
    """loss.backward() on the whole module, micro-batch by micro-batch; returns input grads, .grads."""
    in_grads = []
    for inputs, grads in zip(inputs_per_mb, grads_per_mb, strict=False):
        xs = [x.detach().requires_grad_() if isinstance(x, torch.Tensor) and x.requires_grad else x for x in inputs]
        outs = _tensor_outputs(module(*xs))
        torch.autograd.backward(outs, grads)
        in_grads.append([x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in xs])
    return in_grads, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("mode", ["split", "fused", "split-dropped", "fused-dropped"])
def test_split_backward_matches_autograd(name, mode):
    """``-dropped``: the outputs are let go after F (``Stage.drop_outputs``, as the executor does once it
    has sent them), so B and BW start from the outputs' gradient edges."""
    torch.manual_seed(0)
    make, make_inputs = CASES[name]
    ref_mod = make()
    mod = copy.deepcopy(ref_mod)
    mbs = [make_inputs() for _ in range(2)]
    grads = [[torch.randn_like(o) for o in _tensor_outputs(copy.deepcopy(ref_mod)(*x))] for x in mbs]
    ref_in, ref_grads = _reference(ref_mod, mbs, grads)

    stage = Stage(mod)
    for i, x in enumerate(mbs):
        stage.forward(i, *x)
        if mode.endswith("-dropped"):
            stage.drop_outputs(i)
    mode = mode.removesuffix("-dropped")
    # A weight-only value several ops use (the shared transpose; a GRU's first step, whose hidden-state
    # product with h0 = 0 is one weight-only value split three ways into its gates) is split too: each op's
    # share by its formula. Where one of them has none, the split runs fused and says so (test_formulas).
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got_all = [(stage.backward_input if mode == "split" else stage.backward)(i, grads[i]) for i in range(len(mbs))]
    for i, got in enumerate(got_all):
        assert len(got) == len(mbs[i])
        for g, r in zip(got, ref_in[i], strict=False):
            if r is None:
                assert g is None
            else:
                torch.testing.assert_close(g, r, rtol=RTOL, atol=ATOL)
    if mode == "split":
        if name == "embedding-first":
            # no input grad to split off, or a graph that cannot be split: B runs the whole backward
            assert stage.deferred_fraction < 1.0
            assert all(p.grad is not None for p in mod.parameters() if p.requires_grad)
        else:
            assert all(p.grad is None for p in mod.parameters()), "B must leave the weight grads to W"
        stage.backward_weight([0, 1])
    assert stage.in_flight == ()
    got_grads = {n: p.grad for n, p in mod.named_parameters() if p.grad is not None}
    assert got_grads.keys() == ref_grads.keys()
    for n in ref_grads:
        torch.testing.assert_close(got_grads[n], ref_grads[n], rtol=RTOL, atol=ATOL, msg=n)
        assert got_grads[n].grad_fn is None and not got_grads[n].requires_grad, f"{n}.grad carries a graph"


# A parameter used by two ops of the stage gets each op's gradient added to .grad on its own, where autograd
# sums the two first: in bf16 that rounds once more (1 ulp of the sum), so those are left out below (an RNN's
# hidden weight is used once per time step; a weight-only value several ops use, each op's share by its formula).
SUMMED_IN_TWO = {"twice", "mid-embedding-tied", "rnn", "gru", "tied-transpose"}


@pytest.mark.parametrize("name", sorted(set(CASES) - SUMMED_IN_TWO))
def test_split_in_bf16_rounds_as_the_fused_backward(name):
    """bf16 weights ("bf16-true"), 3 micro-batches: B + W give .grad bit for bit as loss.backward() per
    micro-batch. W's addmm_ into a Linear's gradient rounded the product and the sum once, where the
    fused backward rounds the product to bf16 and then the sum: 1 ulp off per micro-batch after the first."""
    torch.manual_seed(0)
    make, make_inputs = CASES[name]
    ref_mod = make().to(torch.bfloat16)
    mod = copy.deepcopy(ref_mod)

    def bf16(x):
        return x.detach().bfloat16().requires_grad_(x.requires_grad) if torch.is_floating_point(x) else x

    mbs = [tuple(bf16(x) if isinstance(x, torch.Tensor) else x for x in make_inputs()) for _ in range(3)]
    grads = [[torch.randn_like(o) for o in _tensor_outputs(copy.deepcopy(ref_mod)(*x))] for x in mbs]
    _, ref_grads = _reference(ref_mod, mbs, grads)
    stage = Stage(mod)
    for i, x in enumerate(mbs):
        stage.forward(i, *x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no split here runs fused
        for i in range(3):
            stage.backward_input(i, grads[i])
        for i in range(3):
            stage.backward_weight(i)
    for n, g in ref_grads.items():
        torch.testing.assert_close(mod.get_parameter(n).grad, g, rtol=0, atol=0, msg=n)


class ReluLast(nn.Module):
    """A Linear then a ReLU, which saves its own output for the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


@pytest.mark.parametrize("mode", ["split", "fused"])
def test_dropped_outputs_free_their_storage(mode):
    """Once the caller lets go of its output too (the executor, once the send is done), nothing of the
    stage holds the output's storage, and B, W and BW are exact; a None gradient is a zero one."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    ref = copy.deepcopy(lin)
    x = _x(4, 8)
    stage = Stage(lin)
    out = stage.forward(0, x)
    kept = StorageWeakRef(out.untyped_storage())
    stage.drop_outputs(0)
    del out
    gc.collect()
    assert kept.expired(), "the stage still holds its dropped output"
    g = torch.randn(4, 8)
    got = stage.backward_input(0, [g]) if mode == "split" else stage.backward(0, [g])
    if mode == "split":
        stage.backward_weight(0)
    x_ref = x.detach().requires_grad_()
    ref(x_ref).backward(g)
    torch.testing.assert_close(got[0], x_ref.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=RTOL, atol=ATOL)
    # a None gradient for a dropped output is a zero one, of the output's shape
    stage.forward(1, x)
    stage.drop_outputs(1)
    zero = stage.backward(1, [None])
    assert zero[0].shape == x.shape and not zero[0].any()


def test_a_dropped_output_that_autograd_saved_lives_until_b():
    stage = Stage(ReluLast())
    out = stage.forward(0, _x(4, 8))
    kept = StorageWeakRef(out.untyped_storage())
    stage.drop_outputs(0)
    del out
    gc.collect()
    assert not kept.expired(), "ReLU's backward reads its output: autograd keeps it until B"
    stage.backward(0, torch.ones(4, 8))
    gc.collect()
    assert kept.expired()


def test_a_first_stage_lets_its_micro_batch_go_at_b():
    """A stage whose input takes no gradient (the first, fed the data) runs its whole backward in B and has nothing
    left for W: its input goes at B, not at W (it held the micro-batch's data until W, which the memory model
    does not count: the first rank measured 1536 bytes over auto's prediction under 1F1B + 2BP)."""
    stage = Stage(nn.Linear(8, 8))
    x = torch.randn(4, 8)  # no gradient: the data
    out = stage.forward(0, x)
    kept = StorageWeakRef(x.untyped_storage())
    del x
    stage.backward_input(0, [torch.ones_like(out)])
    del out
    gc.collect()
    assert kept.expired(), "the first stage still holds its input after B"
    stage.backward_weight(0)  # a no-op, as before


def test_w_never_reruns_the_input_chain():
    torch.manual_seed(0)
    stage = Stage(WithCustomFn())
    Square.calls = 0
    stage.forward(0, _x(4, 8))
    stage.backward_input(0, torch.ones(4, 8))
    assert Square.calls == 1
    stage.backward_weight(0)
    assert Square.calls == 1, "W re-ran a node of the input-grad chain"
    assert stage.deferred_fraction == 1.0


def test_split_defers_every_weight_edge_on_a_llama_block():
    stage = Stage(Block(LlamaConfig(dim=32, n_heads=4, max_seq_len=16)))
    stage.forward(0, _x(2, 7, 32))
    stage.backward_input(0, torch.ones(2, 7, 32))
    assert all(p.grad is None for p in stage.module.parameters()), "B accumulated weight grads"
    stage.backward_weight(0)
    assert all(p.grad is not None for p in stage.module.parameters())
    assert stage.deferred_fraction == 1.0


def test_a_micro_batch_run_fused_in_a_split_stage_counts_as_taken_in_b():
    """A split schedule fused in part (schedules.fusion): the fraction W computed counts the fused ones."""
    stage = Stage(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)))
    for mb in range(2):
        stage.forward(mb, _x(4, 8))
    stage.backward_input(0, torch.ones(4, 8))
    stage.backward_weight(0)
    assert stage.deferred_fraction == 1.0
    stage.backward(1, torch.ones(4, 8))  # its four weights taken in the fused backward
    assert stage.deferred_fraction == 0.5, (stage.deferred_edges, stage.early_edges)


@pytest.mark.parametrize("mode", ["split", "fused"])
def test_memory_returns_to_baseline(mode):
    """Everything a micro-batch saved for backward is freed once its W (or BW) is done."""
    torch.manual_seed(0)
    stage = Stage(Block(LlamaConfig(dim=32, n_heads=4, max_seq_len=16)))
    weights = [*stage.module.parameters(), *stage.module.buffers()]  # these live on anyway
    params = {p.untyped_storage().data_ptr() for p in weights}
    saved: list[StorageWeakRef] = []  # storages, not tensor objects: W may hold another view of one

    def pack(t):
        # Return a detached alias, not ``t``: a hook that returns a saved *output* itself makes a
        # reference cycle through its grad_fn that Python's gc cannot see (it would leak by itself).
        t = t.detach()
        if t.untyped_storage().data_ptr() not in params:
            saved.append(StorageWeakRef(t.untyped_storage()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for mb in range(3):
            stage.forward(mb, _x(2, 7, 32))
    assert saved
    for mb in range(3):
        if mode == "split":
            stage.backward_input(mb, torch.ones(2, 7, 32))
        else:
            stage.backward(mb, torch.ones(2, 7, 32))
    if mode == "split":
        gc.collect()
        assert any(not r.expired() for r in saved), "B must keep what W needs"
        stage.backward_weight(range(3))
    gc.collect()
    alive = [r for r in saved if not r.expired()]
    assert not alive, f"{len(alive)} saved tensors outlived their micro-batch"
    assert stage.in_flight == ()


def test_loss_output_with_implicit_grad():
    torch.manual_seed(0)
    lin = nn.Linear(8, 1)
    ref = copy.deepcopy(lin)
    x = _x(4, 8)
    ref(x.detach()).pow(2).mean().backward()
    stage = Stage(nn.Sequential(lin))
    stage.module.register_forward_hook(lambda m, i, o: o.pow(2).mean())
    stage.forward(0, x.detach())
    stage.backward_input(0, None)
    stage.backward_weight(0)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=RTOL, atol=ATOL)


def test_loss_output_with_implicit_grad_on_a_split_stage():
    """grad_outputs=None (dL/dL = 1) on a stage whose input needs a gradient: B and W split."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    ref = copy.deepcopy(block)
    x = _x(4, 8)
    xr = x.detach().requires_grad_()
    ref(xr).pow(2).mean().backward()
    stage = Stage(block)
    block.register_forward_hook(lambda m, i, o: o.pow(2).mean())
    stage.forward(0, x)
    (gx,) = stage.backward_input(0, None)
    assert all(q.grad is None for q in block.parameters())
    stage.backward_weight(0)
    torch.testing.assert_close(gx, xr.grad, rtol=RTOL, atol=ATOL)
    for q, r in zip(block.parameters(), ref.parameters(), strict=False):
        torch.testing.assert_close(q.grad, r.grad, rtol=RTOL, atol=ATOL)


def test_w_rejects_repeated_ids():
    stage = Stage(nn.Linear(4, 4))
    stage.forward(0, _x(2, 4))
    stage.backward_input(0, torch.ones(2, 4))
    with pytest.raises(ValueError, match="repeats"):
        stage.backward_weight([0, 0])


def test_misuse_gets_clear_errors():
    stage = Stage(nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match="no forward in flight"):
        stage.backward_input(0, torch.ones(2, 4))
    stage.forward(0, _x(2, 4))
    with pytest.raises(RuntimeError, match="already in flight"):
        stage.forward(0, _x(2, 4))
    with pytest.raises(RuntimeError, match="has not run B"):
        stage.backward_weight(0)
    with pytest.raises(ValueError, match="single scalar output"):
        stage.backward_input(0, None)
    with pytest.raises(ValueError, match="1 outputs that require grad"):
        stage.backward_input(0, [torch.ones(2, 4), torch.ones(2, 4)])


def test_a_parameter_of_another_stage_in_the_graph_is_refused_at_the_first_forward():
    """B and W compute the gradients of the stage's own parameters only: a parameter of another module in the
    graph (under Lightning: a penalty of stage 0's weight in the loss stage 3 computes, both on rank 0 under
    ZB-V) lost its gradient silently (a trial: 0.003 off one process after 3 steps). Refused at the first F,
    named where the caller gave names; the stage's own parameters and its inputs are not refused."""
    first, last = nn.Linear(3, 3), nn.Linear(3, 1)

    class Penalized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.last = last

        def forward(self, x):
            return self.last(x).mean() + 0.01 * first.weight.abs().sum() + 0.01 * self.last.weight.abs().sum()

    stage = Stage(Penalized())
    stage.names = {id(first.weight): "layers.0.weight (pipeline stage 0)"}
    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(
        RuntimeError, match=r"layers.0.weight \(pipeline stage 0\) is used in the graph .* would be lost"
    ):
        stage.forward(0, x)
    fine = Stage(nn.Sequential(last))
    fine.forward(0, x)
    fine.backward(0, torch.ones(2, 1))
    assert last.weight.grad is not None


def test_a_set_aside_weight_reached_directly_is_named_with_the_tie_as_a_module():
    """A weight of a layer another rank holds is on the meta device here; a forward that reaches it directly, not
    through its module (torchtune's TiedLinear keeps the embedding module outside the module tree, so no placeholder
    stands in for it), computed on meta with it. Refused at the first F, named, with the fix: a head of its own."""
    embed = nn.Embedding(5, 3, device="meta")

    class TiedHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(3)
            self.tied = [embed]  # outside the module tree, as TiedLinear holds it

        def forward(self, h):
            return torch.nn.functional.linear(self.norm(h), self.tied[0].weight)

    stage = Stage(TiedHead())
    stage.names = {id(embed.weight): "model.tok_embeddings.weight (pipeline stage 0, held by pipeline rank 0)"}
    with pytest.raises(
        RuntimeError,
        match=r"model.tok_embeddings.weight \(pipeline stage 0, held by pipeline rank 0\) is used by this pipeline "
        r"stage's forward, but this rank does not hold it .*head.weight = embed.weight",
    ):
        stage.forward(0, torch.randn(2, 4, 3, requires_grad=True))


# ------------------------------------------------------------------------------ custom autograd.Functions with weights
class LinFn(torch.autograd.Function):
    """``x @ w.T`` whose backward returns both gradients, counting its calls. A Python Function cannot tell which
    of them the engine wants: ``ctx.needs_input_grad`` is fixed at forward."""

    calls = 0

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        LinFn.calls += 1
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x


class FillFn(torch.autograd.Function):
    """``x @ w.T + b`` whose backward accumulates the weight's ``.grad`` itself and returns None for it (fused
    weight-gradient-accumulation Linears), and returns the bias's gradient as usual."""

    calls = 0

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):
        FillFn.calls += 1
        x, w = ctx.saved_tensors
        with torch.no_grad():
            gw = g.t() @ x
            if w.grad is None:
                w.grad = gw
            else:
                w.grad.add_(gw)
        return g @ w, None, g.sum(0)


class Assigns(torch.autograd.Function):
    """Reformer style: the weight is not an input; the backward assigns its ``.grad`` (no autograd accumulation)."""

    @staticmethod
    def forward(ctx, x, lin):
        ctx.save_for_backward(x)
        ctx.lin = lin
        return x @ lin.weight.detach().t()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        w = ctx.lin.weight
        with torch.no_grad():
            w.grad = g.t() @ x if w.grad is None else w.grad + g.t() @ x
        return g @ w.detach(), None


class CustomLinear(nn.Linear):
    """A Linear whose product is ``fn``: LinFn, FillFn (with its bias) or Assigns."""

    def __init__(self, fn: type[torch.autograd.Function]) -> None:
        super().__init__(8, 8, bias=fn is FillFn)
        self.fn = fn

    def forward(self, x):
        if self.fn is FillFn:
            return FillFn.apply(x, self.weight, self.bias)
        return self.fn.apply(x, self if self.fn is Assigns else self.weight)


class Checkpointed(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.m = module

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.m, x, use_reentrant=False)


def _custom_stack(fn: type[torch.autograd.Function]) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), CustomLinear(fn), nn.Tanh(), nn.Linear(8, 8))


def _split_interleaved(module: nn.Module) -> Stage:
    """Three micro-batches, F0 F1 B0 B1 W0 F2 B2 W(1, 2), against plain autograd at rtol 1e-6; the stage."""
    torch.manual_seed(1)
    ref = copy.deepcopy(module)
    xs = [_x(4, 8) for _ in range(3)]
    gs = [torch.randn(4, 8) for _ in range(3)]
    ref_in, ref_grads = _reference(ref, [(x,) for x in xs], [[g] for g in gs])
    stage = Stage(module)
    stage.names = {id(q): n for n, q in module.named_parameters()}
    got = []
    stage.forward(0, xs[0])
    stage.forward(1, xs[1])
    got += [stage.backward_input(0, gs[0]), stage.backward_input(1, gs[1])]
    stage.backward_weight(0)
    stage.forward(2, xs[2])
    got.append(stage.backward_input(2, gs[2]))
    stage.backward_weight([1, 2])
    for g, r in zip(got, ref_in, strict=True):
        torch.testing.assert_close(g[0], r[0], rtol=1e-6, atol=1e-7)
    for n, q in module.named_parameters():
        torch.testing.assert_close(q.grad, ref_grads[n], rtol=1e-6, atol=1e-7, msg=n)
    return stage


def test_a_function_that_writes_its_weights_grad_is_taken_in_b_once():
    """Fails without taking a Python Function's weights in B (``_Split.add``): the weight's gradient came out exactly
    twice plain autograd's, with deferred_fraction 1.0 and no warning (B ran the Function's backward, which wrote
    ``.grad``; W re-entered the node for the weight's edge and ran it again)."""
    FillFn.calls = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stage = _split_interleaved(_custom_stack(FillFn))
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1, said
    assert (
        "FillFnBackward is a Python autograd.Function" in said[0] and "(1.weight and 1 more) are taken in B" in said[0]
    )
    assert "split_backward=False" in said[0]
    # per micro-batch: the two nn.Linears' 4 edges in W; FillFn's 2 (weight, bias) taken in B
    assert stage.deferred_fraction == pytest.approx(4 / 6)
    assert FillFn.calls == 3 + 3  # the reference's 3; each micro-batch's once, in B


def test_a_function_that_assigns_a_weight_grad_it_does_not_take_is_counted_in_b():
    """Fails with ``_Hidden`` on post-accumulate-grad hooks (before): a ``.grad =`` fires none, so the weight taken
    in B went unsaid and deferred_fraction said 1.0."""
    with pytest.warns(RuntimeWarning, match=r"1 parameter\(s\) \(1.weight first\) got their gradients in B"):
        stage = _split_interleaved(_custom_stack(Assigns))
    assert stage.deferred_fraction == pytest.approx(4 / 5)  # the Linears' 4 edges in W, Assigns' weight in B


def test_a_python_functions_weights_are_taken_in_b_in_its_one_run():
    """A Python Function's backward returns every gradient at once (``ctx.needs_input_grad`` is fixed at forward):
    W re-entering its node ran its whole backward a second time, input half included (calls 3 + 6). Now B runs it
    once and takes its weight gradients there, and says so."""
    LinFn.calls = 0
    with pytest.warns(
        RuntimeWarning, match=r"LinFnBackward is a Python autograd.Function .* \(1.weight\) are taken in B"
    ):
        stage = _split_interleaved(_custom_stack(LinFn))
    assert LinFn.calls == 3 + 3  # the reference's 3; the stage's 3 micro-batches, each once
    assert stage.deferred_fraction == pytest.approx(4 / 5)  # the Linears' 4 edges in W, LinFn's weight in B


class ScalesSaved(torch.autograd.Function):
    """Liger-Kernel's fused linear cross-entropy, in small: the forward computes both gradients and saves them; the
    backward scales them in place by the incoming gradient (Liger's Triton kernel writes them in place, out of
    autograd's sight: ``.data`` here) and returns them. Running that backward twice scales them twice."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.grads = (torch.ones_like(x) @ w, torch.ones(x.shape[0], w.shape[0]).t() @ x)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        gx, gw = ctx.grads
        if not torch.equal(g, torch.ones_like(g)):
            gx.data.mul_(g.mean())
            gw.data.mul_(g.mean())
        return gx, gw


class ScaledLinear(nn.Linear):
    def __init__(self) -> None:
        super().__init__(8, 8, bias=False)

    def forward(self, x):
        return ScalesSaved.apply(x, self.weight)


def test_a_function_whose_backward_changes_what_it_saved_runs_once():
    """Fails where W re-enters the Function's node (before): its second run scaled the saved gradients again, so
    the weight's gradient was off by the incoming gradient's factor, and the input gradient B had already handed
    on was rescaled in place. A cold review's case (Liger-Kernel, on GPUs); exact against plain autograd now
    (``_split_interleaved`` compares both)."""
    g = torch.full((4, 8), 0.25)
    module = nn.Sequential(nn.Linear(8, 8), ScaledLinear(), nn.Linear(8, 8))
    ref = copy.deepcopy(module)
    x = _x(4, 8)
    _, ref_grads = _reference(ref, [(x,)], [[g]])
    stage = Stage(module)
    with pytest.warns(RuntimeWarning, match="ScalesSavedBackward is a Python autograd.Function"):
        stage.forward(0, x.detach().clone().requires_grad_())
        (gx,) = stage.backward_input(0, g)
        held = gx.clone()
        stage.backward_weight(0)
    torch.testing.assert_close(gx, held)  # what B handed on is not changed afterwards
    for n, q in module.named_parameters():
        torch.testing.assert_close(q.grad, ref_grads[n], rtol=1e-6, atol=1e-7, msg=n)


def test_a_checkpointed_function_without_formula_taken_in_b_is_said():
    """Fails without ``Stage._checkpointed_in_b``: inside a checkpointed block the Function's weights were taken in
    B (deferred_fraction 0.5) and nothing was said, where the other fallback warns."""
    module = nn.Sequential(nn.Linear(8, 8), Checkpointed(nn.Sequential(CustomLinear(LinFn), nn.Tanh())))
    with pytest.warns(
        RuntimeWarning,
        match=r"in an activation-checkpointed block, LinFnBackward has no W formula, so the weight gradients it "
        r"leads to \(1.m.0.weight\) are taken in B",
    ):
        stage = _split_interleaved(module)
    assert stage.deferred_fraction == pytest.approx(2 / 3)  # the Linear's 2 edges in W, the Function's in B


class MadeShared(nn.Module):
    """A weight made once (``w.exp()``, which saves its result) and read twice: through a Python Function (its
    weight taken in B, pushed through the made value) and by an ``F.linear`` whose W formula carries its share
    through the same nodes; ``returned`` also returns a slice of it, an output that reaches no input."""

    def __init__(self, returned: bool = False) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(8, 8), nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.returned = returned

    def forward(self, x):
        h, e = self.a(x), self.w.exp()
        y = self.c(torch.tanh(LinFn.apply(h, e * 2)) + F.linear(torch.sin(h), e))
        return (y, e[:4] * 1.0) if self.returned else y


@pytest.mark.filterwarnings("ignore:2BP split:RuntimeWarning")
@pytest.mark.parametrize("returned", [False, True])
def test_a_functions_weight_made_once_and_read_elsewhere_too(returned):
    """Fails when B's push through the made weight frees it (a cold review of taking a Function's weights in B): W's
    push through the same nodes, or W's backward of the output that reaches no input, raised torch's "backward
    through the graph a second time"."""
    torch.manual_seed(0)
    module = MadeShared(returned)
    ref = copy.deepcopy(module)
    xs = [_x(4, 8) for _ in range(3)]
    gs = [[torch.randn(4, 8)] + ([torch.randn(4, 8)] if returned else []) for _ in range(3)]
    _, ref_grads = _reference(ref, [(x,) for x in xs], gs)
    stage = Stage(module)
    for m, x in enumerate(xs):
        stage.forward(m, x.detach().clone().requires_grad_())
    for m, g in enumerate(gs):
        stage.backward_input(m, g if returned else g[0])
    for m in range(3):
        stage.backward_weight(m)
    for n, q in module.named_parameters():
        torch.testing.assert_close(q.grad, ref_grads[n], rtol=1e-5, atol=1e-6, msg=n)


class SigmoidAfterFunction(nn.Module):
    """A Linear, a Python Function holding a weight, then a sigmoid whose backward reads its own output (which no W
    formula reads: the last Linear's input is its tanh)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(8, 8), nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, x):
        self.mid = torch.sigmoid(LinFn.apply(self.a(x), self.w))
        return self.c(torch.tanh(self.mid))


@pytest.mark.filterwarnings("ignore:2BP split:RuntimeWarning")
def test_b_frees_the_graph_when_a_functions_weights_are_taken_in_it():
    """A Python Function's weights are taken in B, so nothing in W reads the graph: B frees it at once (the sigmoid's
    saved output goes), and the micro-batch keeps only its formulas' operands until W, as a stage without a
    Function does. Fails where B retains the graph whenever it takes edges (a cold review's finding: the whole
    activation held from B to W)."""
    torch.manual_seed(0)
    module = SigmoidAfterFunction()
    ref = copy.deepcopy(module)
    x, g = _x(4, 8), torch.randn(4, 8)
    stage = Stage(module)
    stage.forward(0, x.detach().clone().requires_grad_())
    kept = StorageWeakRef(module.mid.untyped_storage())
    del module.mid
    stage.backward_input(0, g)
    gc.collect()
    assert kept.expired(), "B kept the graph (the sigmoid's saved output) until W"
    stage.backward_weight(0)
    _, ref_grads = _reference(ref, [(x,)], [[g]])
    for n, q in module.named_parameters():
        torch.testing.assert_close(q.grad, ref_grads[n], rtol=1e-6, atol=1e-7, msg=n)
