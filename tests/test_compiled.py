"""torch.compile: refused before the first step with what is compiled and what to do, never dropped."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_twobp.engine import Stage
from lightning_twobp.lightning.compiled import check_not_compiled
from lightning_twobp.lightning.contract import find_contract


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


def _check(model: nn.Module) -> None:
    check_not_compiled(model, find_contract(model))


def test_compiled_layers_wrapper_is_named_not_dropped():
    model = Model()
    model.layers = torch.compile(model.layers)
    with pytest.raises(ValueError, match=r"torch.compile\(layers\) would be silently dropped.*Remove"):
        _check(model)


@pytest.mark.parametrize("how", ["wrapped", "in-place"])
def test_a_compiled_layer_with_weights_is_named(how):
    model = Model()
    if how == "wrapped":
        model.layers[2] = torch.compile(model.layers[2])
    else:
        model.layers[2].compile()
    with pytest.raises(ValueError, match=r"layers\[2\].*holds weights"):
        _check(model)


class Outer(nn.Module):
    """A model holding the model whose layers are pipelined (a LightningModule's ``self.model``)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Model()


@pytest.mark.parametrize("how", ["container in place", "holder in place", "holder wrapped"])
def test_a_compiled_module_around_the_layers_is_named(how):
    """Compiling the pipelined container, or a module whose forward runs it, failed in the first step inside
    torch's compiler (the pipeline runs that forward cut into stages): refused at setup, named."""
    outer = Outer()
    if how == "container in place":
        outer.model.layers.compile()
        name = "model.layers"
    elif how == "holder in place":
        outer.model.compile()
        name = "model"
    else:
        outer.model = torch.compile(outer.model)
        name = "model"
    contract = find_contract(outer)
    named = rf"(^{name} is compiled with torch.compile and its forward|would be silently)"
    with pytest.raises(ValueError, match=named):
        check_not_compiled(outer, contract)


class Loop(nn.Module):
    """A base model whose forward loops over its blocks (a Hugging Face model's ``.model``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return x


class Held(nn.Module):
    """A LightningModule's ``self.model`` holding the base model (``AutoModelForCausalLM``'s ``.model``)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Loop()

    def forward(self, x):
        return self.model(x)


@pytest.mark.parametrize("how", ["in place", "wrapped"])
def test_a_compiled_base_model_of_a_modulelist_is_named(how):
    """A ModuleList contract's name is its top holder's: the base model under it, compiled, got through setup
    and failed in the first step inside dynamo (a review's catch)."""
    outer = nn.Module()
    outer.model = Held()
    if how == "in place":
        outer.model.model.compile()
    else:
        outer.model.model = torch.compile(outer.model.model)
    contract = find_contract(outer, layers="model.model.layers")
    with pytest.raises(ValueError, match=r"^model\.model is compiled with torch.compile .*\(model\.model\.layers\)"):
        check_not_compiled(outer, contract)
    outer.model.model = Loop()  # the list itself compiled: iterated, never called, so allowed
    outer.model.model.layers.compile()
    check_not_compiled(outer, find_contract(outer, layers="model.model.layers"))


def test_compiling_what_holds_no_weights_is_allowed():
    model = Model()
    model.layers[1] = torch.compile(model.layers[1])
    _check(model)


def test_a_compiled_lightning_module_is_refused():
    model = Model()
    model._compiler_ctx = {"compiler": "dynamo"}  # what Lightning's from_compiled(torch.compile(lm)) records
    with pytest.raises(ValueError, match=r"torch.compile\(Model\).*to_uncompiled"):
        _check(model)


def test_the_engine_refuses_a_compiled_region_with_weights():
    torch.manual_seed(0)
    inner = nn.Linear(4, 4)
    compiled = torch.compile(inner, backend="aot_eager")
    stage = Stage(nn.Sequential(compiled, nn.Tanh()))
    stage.forward(0, torch.randn(2, 4, requires_grad=True))
    with pytest.raises(RuntimeError, match="torch.compile'd region of this stage holds weights"):
        stage.backward_input(0, torch.ones(2, 4))
