"""Activation checkpointing under the split, on one stage: the user's torch.utils.checkpoint and the
strategy's option (``activation_checkpointing``, "selective" included), exact, each checkpointed block's
forward run twice per micro-batch (F, and B's one recompute whose operands W keeps), the reentrant form
refused at the first F.
Through the Trainer on 2 ranks: tests/test_activation_checkpointing.py."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from test_plan_checkpointing import allocated_bytes
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_twobp.engine import Stage
from lightning_twobp.engine.footprint import measure_layer
from lightning_twobp.engine.graph import READS, check_checkpoint_peek, unreadable
from lightning_twobp.lightning.checkpointing import apply_activation_checkpointing, check_activation_checkpointing
from lightning_twobp.models.llama import Block, LlamaConfig
from lightning_twobp.models.mamba import MambaBlock
from lightning_twobp.models.resnet import Bottleneck
from lightning_twobp.private import TorchDispatchMode


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


def _split_against_plain(blocks: list[Counted], stage_module: nn.Module) -> list[int]:
    """Two micro-batches through ``Stage(stage_module)``'s F, B, W against the same blocks run plainly
    (copies made first): every gradient equal (rtol 1e-6); returns each block's forward count."""
    ref = copy.deepcopy(blocks)
    for r in ref:
        vars(r).pop("forward", None)  # the option's wrapper would call the original block
    stage = Stage(stage_module)
    xs = [torch.randn(2, 7, 32) for _ in range(2)]
    gs = [torch.randn(2, 7, 32) for _ in range(2)]
    for mb, x in enumerate(xs):
        stage.forward(mb, x.requires_grad_())
    for mb, g in enumerate(gs):
        stage.backward_input(mb, g)
        assert stage._pending[mb].frontier == [], "a weight went back through autograd: W would recompute"
    stage.backward_weight([0, 1])
    for x, g in zip(xs, gs, strict=True):
        nn.Sequential(*ref)(x.detach()).backward(g)
    for b, r in zip(blocks, ref, strict=True):
        for (n, q), p in zip(b.named_parameters(), r.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=n)
    return [b.calls for b in blocks]


def test_checkpointed_blocks_are_exact_and_recompute_once_for_b_and_w():
    """Forwards per block per micro-batch: F, and one recompute in B whose tensors W's formulas keep, as a
    plain backward (was 1 in F + 10 in B on this 3-block stage, then 3)."""
    torch.manual_seed(0)
    blocks = [Counted() for _ in range(3)]
    assert _split_against_plain(blocks, Checkpointed(blocks)) == [4, 4, 4], "forwards over 2 micro-batches"


class Logged(nn.Module):
    """Checkpointed blocks that log each block's forward and the gradient reaching its output."""

    def __init__(self, blocks: list[Counted]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.log: list[tuple[str, int]] = []

    def _run(self, i: int, x: torch.Tensor) -> torch.Tensor:
        self.log.append(("forward", i))
        return self.blocks[i](x)

    def forward(self, x):
        for i in range(len(self.blocks)):
            x = checkpoint(functools.partial(self._run, i), x, use_reentrant=False)
            x.register_hook(lambda g, i=i: self.log.append(("grad", i)))
        return x


def test_b_recomputes_each_block_when_its_backward_comes():
    """B recomputes block by block, as a plain backward does, so it holds one block's recomputed activations
    at a time, not the stage's (W's operands read in the engine call, see Stage._input_half; read before
    it, they recomputed every block first: forward 0, 1, 2, then the gradients), and stays exact."""
    torch.manual_seed(0)
    blocks = [Counted() for _ in range(3)]
    ref = copy.deepcopy(blocks)
    module = Logged(blocks)
    stage = Stage(module)
    x, g = torch.randn(2, 7, 32), torch.randn(2, 7, 32)
    for _ in range(2):  # the second micro-batch reuses the first's plan
        module.log.clear()
        stage.forward(0, x.clone().requires_grad_())
        module.log.clear()
        (gx,) = stage.backward_input(0, g)
        stage.backward_weight(0)
        assert module.log == [("grad", 2), ("forward", 2), ("grad", 1), ("forward", 1), ("grad", 0), ("forward", 0)]
    assert [b.calls for b in blocks] == [4, 4, 4]
    xr = x.clone().requires_grad_()
    for _ in range(2):
        nn.Sequential(*ref)(xr).backward(g)
    torch.testing.assert_close(gx, xr.grad / 2, rtol=1e-6, atol=1e-7)
    for b, r in zip(blocks, ref, strict=True):
        for (n, q), p in zip(b.named_parameters(), r.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=n)


def _held_during_b(k: int) -> tuple[int, int]:
    """One micro-batch's B through ``k`` checkpointed blocks whose recompute is mostly what W does not read
    (a chain of tanh, each saving its output, between two Linears): the most the allocator held during B
    beyond its start, and that less what B still held at its end (for W: operands and gradients)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(32, 32), *[nn.Tanh() for _ in range(6)], nn.Linear(32, 32)) for _ in range(k)]
    apply_activation_checkpointing(list(enumerate(blocks)), "full")
    stage = Stage(nn.Sequential(*blocks))
    x, g = torch.randn(256, 32), torch.randn(256, 32)
    for _ in range(2):  # the second is measured: the formulas' probes and the plan are made in the first
        stage.forward(0, x.clone().requires_grad_())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            stage.backward_input(0, g)
        stage.backward_weight(0)
    peak, end = allocated_bytes(prof)
    return peak, peak - end


def test_b_holds_one_blocks_recompute_at_a_time():
    """What B holds beyond what it keeps for W does not grow with the blocks of the stage: one block's
    recompute at a time (it grew by one block's tanh outputs per block when B recomputed all at once)."""
    one, four = _held_during_b(1), _held_during_b(4)
    tensor = 256 * 32 * 4  # bytes of one activation
    assert one[1] >= 4 * tensor, one  # B held a block's recompute a while: the measure sees it
    assert four[1] <= one[1] + tensor, (one, four)  # was one block's 3 tensors more per block
    assert four[0] - four[1] > 3 * (one[0] - one[1]), (one, four)  # what B keeps for W grows with the blocks


def test_operand_reads_share_bs_recompute():
    """The guard of engine.graph.peek: torch's checkpoint holder and unpack hook as it assumes them."""
    check_checkpoint_peek()


def test_reentrant_checkpoint_is_refused_at_the_first_forward():
    module = Checkpointed([Counted()], reentrant=True)
    stage = Stage(module)
    with pytest.raises(RuntimeError, match=r"use_reentrant=True.*Pass use_reentrant=False"):
        stage.forward(0, torch.randn(2, 7, 32, requires_grad=True))
    assert module.blocks[0].calls == 1 and stage.in_flight == (), "refused after one forward, nothing held"


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "some", "FULL"])
def test_bad_values_are_refused_naming_the_choices(bad):
    with pytest.raises(ValueError, match=r"None \(off\), 'full'.*every k-th block"):
        check_activation_checkpointing(bad)


@pytest.mark.parametrize("good", [None, "full", "selective", 1, 3])
def test_the_options_values_are_taken(good):
    assert check_activation_checkpointing(good) == good


@pytest.mark.parametrize(
    ("value", "calls"),
    [("full", [4, 4, 4]), (2, [4, 2, 4]), (None, [2, 2, 2]), ("selective", [4, 4, 4])],
)
def test_checkpointed_stage_is_exact_and_counts_its_forwards(value, calls):
    """Forwards per block over 2 micro-batches: 2 each when checkpointed (F, B's recompute), 1 when not."""
    torch.manual_seed(0)
    blocks = [Counted() for _ in range(3)]
    undo = apply_activation_checkpointing(list(enumerate(blocks)), value)
    assert _split_against_plain(blocks, nn.Sequential(*blocks)) == calls
    undo()
    assert all("forward" not in vars(b) for b in blocks), "the blocks were not left as they were found"


class PReLUBlock(nn.Module):
    """A block whose weight-only region needs autograd in W: PReLU's slope (no formula, so its node is a
    frontier node) and Mamba's ``-exp(A_log)`` (an ExpBackward0 that saved its result)."""

    def __init__(self, mamba: bool) -> None:
        super().__init__()
        self.block = MambaBlock(32) if mamba else nn.Sequential(nn.Linear(32, 32), nn.PReLU(), nn.Linear(32, 32))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.block(x)


@pytest.mark.parametrize("mamba", [False, True], ids=["prelu", "mamba"])
@pytest.mark.parametrize("value", ["full", "selective"])
def test_a_weight_pushed_through_autograd_in_a_checkpointed_block_is_taken_in_b(value, mamba):
    """Such a weight is taken in B's one recompute: exact, 2 forwards per block per micro-batch (was 3
    under "full", and torch's "backward an extra time" error at the first W under "selective"). PReLU's node
    has no W formula: its slopes taken in B are said, once (mamba's ``-exp(A_log)``, a weight-only region B carries
    into the weight, is not: a few elementwise ops)."""
    torch.manual_seed(0)
    blocks = [PReLUBlock(mamba) for _ in range(2)]
    undo = apply_activation_checkpointing(list(enumerate(blocks)), value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _split_against_plain(blocks, nn.Sequential(*blocks)) == [4, 4]
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if mamba:
        assert said == []
    else:
        assert len(said) == 1 and "PreluKernelBackward0 has no W formula" in said[0], said
    undo()


class _Products(TorchDispatchMode):
    """Counts the matrix products, convolutions and attention kernels that run (a product the selective
    policy kept is served from F's store by torch's inner mode and never reaches this outer one)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        costly = name in ("mm", "addmm", "bmm", "convolution")
        self.count += costly or name.startswith("_scaled_dot_product_flash_attention_for")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def probed() -> None:
    """The formulas' one-time probes run (each a small forward of a node kind, on the first plan that meets
    it in the process), so the products a test counts in B are B's alone, whatever ran before it."""
    for name in READS:
        unreadable(name)


def _convolutions_in_b(value) -> int:
    """The convolutions B runs on a ResNet bottleneck checkpointed ``value``'s way (its backward runs
    ``convolution_backward``, not ``convolution``: only a recompute runs these)."""
    torch.manual_seed(0)
    block = Bottleneck(16, 4)
    apply_activation_checkpointing([(0, block)], value)
    stage = Stage(block)
    out = stage.forward(0, torch.randn(2, 16, 8, 8, requires_grad=True))
    with _Products() as products:
        stage.backward_input(0, torch.ones_like(out))
    stage.backward_weight([0])
    return products.count


def test_selective_keeps_a_conv_nets_convolutions(probed):
    """On a conv net the costly ops are the convolutions: "selective" keeps them (B runs none, as without
    checkpointing), "full" runs the block's three again."""
    assert (_convolutions_in_b(None), _convolutions_in_b("selective"), _convolutions_in_b("full")) == (0, 0, 3)


def _one_block(value) -> dict:
    """One block, one micro-batch through a Stage under ``value``: the products B runs and the bytes F
    leaves allocated until B (the profiler's net allocation over F, the output excluded, the input
    counted: every way saves it)."""
    torch.manual_seed(0)
    block = Block(LlamaConfig(dim=32, n_heads=4, max_seq_len=16))
    apply_activation_checkpointing([(0, block)], value)
    stage, x = Stage(block), torch.randn(2, 7, 32, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = stage.forward(0, x)
    kept = sum(e.self_cpu_memory_usage for e in prof.key_averages())
    kept += x.untyped_storage().nbytes() - out.untyped_storage().nbytes()
    with _Products() as products:
        stage.backward_input(0, torch.ones_like(out))
    stage.backward_weight([0])
    return {"products_in_b": products.count, "kept_bytes": kept}


def test_selective_keeps_the_products_and_recomputes_only_the_cheap_ops(probed):
    """B under "selective" runs the products of a plain backward and no more (the recompute's are served
    from F), "full" runs the recomputed ones again; F keeps less than without checkpointing and more than
    "full" (its input only)."""
    off, full, selective = (_one_block(v) for v in (None, "full", "selective"))
    assert selective["products_in_b"] == off["products_in_b"] < full["products_in_b"], (off, full, selective)
    assert full["kept_bytes"] < selective["kept_bytes"] < off["kept_bytes"], (off, full, selective)


def _save_matmuls(ctx, op, *args, **kwargs):
    mm = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    return CheckpointPolicy.MUST_SAVE if mm else CheckpointPolicy.PREFER_RECOMPUTE


class Selective(nn.Module):
    """The user's own selective checkpointing: the matmul outputs kept, the cheap ops recomputed."""

    def __init__(self, blocks: list[Counted]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False, context_fn=context)
        return x


def test_users_selective_checkpointing_is_exact_and_recomputes_once():
    """torch's selective checkpointing serves each kept output to one recompute: B's, shared with W."""
    torch.manual_seed(0)
    blocks = [Counted() for _ in range(2)]
    assert _split_against_plain(blocks, Selective(blocks)) == [4, 4]


def test_checkpointed_block_holds_from_b_to_w_what_a_plain_one_does():
    """After B a checkpointed block keeps only W's operands (the weight GEMMs' inputs) and the recorded
    gradients, the same bytes as without checkpointing, and no graph: the recompute's rest went at B."""
    torch.manual_seed(0)
    plain, checkpointed = Counted(), Counted()
    checkpointed.load_state_dict(plain.state_dict())
    undo = apply_activation_checkpointing([(0, checkpointed)], "full")
    x = torch.randn(2, 7, 32)
    with_ac, without = measure_layer(checkpointed, x, True), measure_layer(plain, x, True)
    undo()
    assert not with_ac.graph_kept and not without.graph_kept
    assert with_ac.held_bytes == without.held_bytes > 0
    assert checkpointed.calls == 2 and plain.calls == 1
