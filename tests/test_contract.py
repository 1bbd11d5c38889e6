"""Finding the Sequential to pipeline, and the errors that name the fix."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_twobp.lightning.contract import find_sequential


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
            r"holds 2 nn.Sequential modules \(decoder, encoder\): name the one that training_step calls with "
            r"layers=..., e.g. layers='decoder'",
        ),
        (nn.Linear(2, 2), None, r"holds no nn.Sequential: put the layers to pipeline in one nn.Sequential"),
        (Two(), "middle", r"layers='middle' names no submodule of Two; Sequentials found: decoder, encoder"),
        (One(), "embed", r"layers='embed' points to Embedding, not to an nn.Sequential"),
    ],
)
def test_errors_name_the_fix(module, layers, match):
    with pytest.raises(ValueError, match=match):
        find_sequential(module, layers=layers)
