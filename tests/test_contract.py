"""Finding the Sequential to pipeline, and the errors that name the fix."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from lightning.pytorch.callbacks import BaseFinetuning
from torch import nn

from lightning_twobp.lightning.contract import find_contract, find_sequential
from lightning_twobp.lightning.local_model import split_model
from lightning_twobp.schedules import build_schedule


class One(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 4)
        self.model = nn.Module()
        self.model.blocks = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 4)))


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 4))
        self.decoder = nn.Sequential(nn.Linear(4, 4))


def test_finds_the_one_outermost_sequential():
    m = One()
    name, seq = find_sequential(m)
    assert name == "model.blocks" and seq is m.model.blocks


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.blocks, self.head = (
            nn.Linear(4, 4),
            nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)),
            nn.Linear(4, 2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def test_a_sequential_a_models_forward_calls_between_trained_modules_is_a_loops_blocks():
    """timm's ViT calls its blocks (one nn.Sequential) between its patch embedding and head: the step's contract
    would refuse their parameters at the first step, so the Sequential is cut as a loop's blocks. The step's own
    call where nothing trainable sits beside it in the model around it: trainable modules elsewhere (a head or a
    teacher the step calls, a probe it never does: a review found these refused after the change), a bare
    container around it, a frozen embedding, or the Sequential at the top."""
    from lightning_twobp.lightning.contract import SequentialContract
    from lightning_twobp.lightning.modulelist_contract import ModuleListContract

    root = nn.Module()
    root.model = _Model()
    assert isinstance(find_contract(root), ModuleListContract) and find_contract(root).list_name == "model.blocks"
    assert isinstance(find_contract(root, layers="model.blocks"), ModuleListContract)
    root.model.embed.requires_grad_(False)
    root.model.head.requires_grad_(False)
    assert isinstance(find_contract(root), SequentialContract)  # nothing trainable beside it
    root.probe = nn.Linear(2, 2)  # trainable, outside the model around the Sequential
    assert isinstance(find_contract(root), SequentialContract)
    assert isinstance(find_contract(One()), SequentialContract)  # a bare nn.Module() around it, embed outside
    top = nn.Module()
    top.layers, top.head = nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2)
    assert isinstance(find_contract(top, layers="layers"), SequentialContract)


def test_a_sequential_model_is_its_own_pipeline():
    seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert find_sequential(seq) == ("", seq)


def test_named_layers():
    m = Two()
    assert find_sequential(m, layers="decoder") == ("decoder", m.decoder)


@pytest.mark.parametrize(
    "module, layers, match",
    [
        (
            Two(),
            None,
            r"holds 2 nn.Sequential modules \(decoder, encoder\): name the one to pipeline with layers=..., e.g. "
            r"layers='decoder'",
        ),
        (nn.Linear(2, 2), None, r"holds no nn.Sequential: put the layers to pipeline in one nn.Sequential"),
        (Two(), "middle", r"layers='middle' names no submodule of Two; Sequentials found: decoder, encoder"),
        (One(), "embed", r"layers='embed' points to Embedding, not to an nn.Sequential"),
    ],
)
def test_errors_name_the_fix(module, layers, match):
    with pytest.raises(ValueError, match=match):
        find_sequential(module, layers=layers)


def test_another_ranks_layers_stand_in_by_type_and_a_call_of_one_names_the_fix():
    """The placeholders of another rank's layers answer isinstance as the layers would (a hook picking
    layers by type builds the same list on every rank), type() still tells them apart; a call of one by the
    model's own code (timm's checkpoint_seq walks the Sequential under set_grad_checkpointing()) says the
    Sequential runs as one call and names the fix."""
    m = One()
    m.embed.requires_grad_(False)  # the Sequential the step calls (trained modules around it: a loop's blocks)
    m.model.blocks = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 4))
    contract = find_contract(m)
    local = split_model(contract, [2, 2], build_schedule("1f1b", 2, 2), pp_rank=0)
    try:
        blocks = m.model.blocks
        assert isinstance(blocks[3], nn.Linear) and type(blocks[3]) is not nn.Linear
        assert isinstance(blocks[2], nn.Sequential) and not isinstance(blocks[2], nn.Linear)
        assert [i for i, b in enumerate(blocks) if isinstance(b, nn.Linear)] == [0, 3]
        # pickled with the network (torch.save of a checkpoint whose hyper_parameters hold it): pickle's
        # __newobj__ checks __class__, which answers as the layer ("args[0] ... has the wrong class")
        again = pickle.loads(pickle.dumps(blocks))
        assert type(again[3]) is type(blocks[3]) and isinstance(again[3], nn.Linear) and len(again[2]) == 1
        with pytest.raises(
            RuntimeError, match=r"model\.blocks\[3\] belongs to pipeline stage 1 .* timm's checkpoint_seq"
        ):
            blocks[3](torch.ones(1, 4))
        # a copy of the model made during the call (timm's ModelEmaV3 in a callback's on_fit_start) says so
        with pytest.raises(RuntimeError, match=r"model\.blocks\[3\] is called in a copy of the model made during"):
            copy.deepcopy(blocks)[3](torch.ones(1, 4))
    finally:
        local.restore(False, None, 0, torch.device("cpu"))
    assert type(m.model.blocks[3]) is nn.Linear


class _Embeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(5, 4)
        self.norm = nn.LayerNorm(4)


def _tied_in_a_submodule() -> nn.Module:
    m = nn.Module()
    m.blocks = nn.Sequential(_Embeddings(), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 5, bias=False))
    m.blocks[3].weight = m.blocks[0].tok.weight
    return m


def test_finetuning_freezes_a_tied_weight_in_a_submodule_of_another_stages_layer():
    """BaseFinetuning.freeze walks the leaves and their parameters(recurse=False); another stage's layer is one
    leaf here, its placeholder, and the head's copy of the tied weight in its submodule ``tok`` stayed trainable
    on the last stage, while one process (and the first stage) froze it."""
    one = _tied_in_a_submodule()
    BaseFinetuning.freeze(one.blocks[0])
    assert not one.blocks[3].weight.requires_grad
    m = _tied_in_a_submodule()
    local = split_model(find_contract(m), [2, 2], build_schedule("1f1b", 2, 2), pp_rank=1)
    try:
        BaseFinetuning.freeze(m.blocks[0])
        assert not m.blocks[3].weight.requires_grad
        # its values only: the norm's are not here
        assert [id(q) for q in m.blocks[0].parameters()] == [id(m.blocks[3].weight)]
    finally:
        local.restore(False, None, 1, torch.device("cpu"))


class AddsInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x += 1
        return x


@pytest.mark.parametrize(
    "first",
    [
        lambda: nn.ReLU(inplace=True),
        # torchvision's EfficientNet classifier: the in-place layer inside a Sequential
        lambda: nn.Sequential(nn.Sequential(nn.Dropout(0.0, inplace=True), nn.ReLU(inplace=True))),
    ],
)
def test_a_stage_that_starts_in_place_works_on_a_copy_of_its_input(first):
    from lightning_twobp.engine import Stage
    from lightning_twobp.lightning.contract import StageModule

    torch.manual_seed(0)
    layers = [first(), nn.Linear(4, 2)]
    stage, x = Stage(StageModule(layers)), torch.randn(3, 4, requires_grad=True)
    out = stage.forward(0, x)
    (gx,) = stage.backward(0, torch.ones_like(out))
    xr = x.detach().clone().requires_grad_()
    nn.Sequential(*layers)(xr.clone()).sum().backward()
    torch.testing.assert_close(gx, xr.grad)


def test_a_stage_that_changes_its_input_in_place_otherwise_is_told_the_fix():
    from lightning_twobp.engine import Stage

    stage = Stage(nn.Sequential(AddsInPlace(), nn.Linear(4, 2)))
    told = r"(?s)this pipeline stage, or a parameter of its, is changed in place .*inplace=False"
    with pytest.raises(RuntimeError, match=told):
        stage.forward(0, torch.randn(3, 4, requires_grad=True))


class ScalesItsWeight(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.weight.mul_(1.0)
        return super().forward(x)


def test_a_parameter_changed_in_place_on_a_first_stage_keeps_torchs_message():
    """No input of the stage requires grad: the leaf autograd refuses is not its input; torch's message stays."""
    from lightning_twobp.engine import Stage

    with pytest.raises(RuntimeError, match=r"^a leaf Variable that requires grad is being used in an in-place"):
        Stage(ScalesItsWeight(4, 2)).forward(0, torch.randn(3, 4))
