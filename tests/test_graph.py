"""The fence around autograd nodes' private attributes, and the split's fast path it feeds."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_twobp.engine import Stage, formulas
from lightning_twobp.engine.graph import READS, SavedUnavailable, check_saved_attributes, saved
from lightning_twobp.models.llama import Block, LlamaConfig


def test_saved_attributes_the_fast_path_reads_still_exist():
    """Fails loudly when a torch release renames or changes a node attribute the fast W reads."""
    check_saved_attributes()
    assert set(READS) == {
        "MmBackward0",
        "AddmmBackward0",
        "MulBackward0",
        "AddBackward0",
        "ConvolutionBackward0",
        "NativeBatchNormBackward0",
        "NativeLayerNormBackward0",
        "EmbeddingBackward0",
        "GroupedMmBackward0",
    }


def test_a_gpu_batch_norm_in_training_gives_its_weight_gradients_in_b():
    """cuDNN's and MIOpen's batch norm (a GPU's) make the scale and bias gradients in the input gradient's
    call: B takes them, as the CPU's in training. Their node classes exist in every build of torch, so the
    flag read is checked here; the node itself only on a GPU."""
    from lightning_twobp.engine import formulas

    class Node:
        def __init__(self, name: str, training: bool) -> None:
            self._name, self._saved_training = name, training

        def name(self) -> str:
            return self._name

    for name in ("CudnnBatchNormBackward0", "MiopenBatchNormBackward0"):
        assert "_saved_training" in dir(getattr(torch._C._functions, name)), name
        assert formulas.by_product(Node(name, True)) and not formulas.by_product(Node(name, False))
        assert formulas.flags(Node(name, True)) == (True,)


def test_a_missing_attribute_is_a_typed_error():
    node = (torch.randn(2, requires_grad=True) * 2).grad_fn
    with pytest.raises(SavedUnavailable, match="no saved attribute 'nonexistent'"):
        saved(node, "nonexistent")


def _block_stage() -> Stage:
    torch.manual_seed(0)
    return Stage(Block(LlamaConfig(dim=32, n_heads=4, n_kv_heads=2, max_seq_len=16)))


def test_every_llama_weight_takes_the_direct_formula_and_b_frees_the_graph():
    stage = _block_stage()
    stage.forward(0, torch.randn(2, 7, 32, requires_grad=True))
    stage.backward_input(0, torch.ones(2, 7, 32))
    pending = stage._pending[0]
    params = list(stage.module.parameters())
    assert pending.frontier == [], "some weight grads need the autograd graph kept until W"
    assert pending.outputs == [], "B kept the graph"
    assert {id(q) for f, _ in pending.fast for q in f.params} == {id(q) for q in params}, "a weight took the slow path"
    stage.backward_weight(0)
    assert stage.deferred_fraction == 1.0 and all(q.grad is not None for q in params)


def test_a_failed_read_falls_back_exactly_and_warns_once(monkeypatch):
    ref = _block_stage()
    x = torch.randn(2, 7, 32, requires_grad=True)
    out = ref.module(x)
    out.backward(torch.ones_like(out))

    monkeypatch.setattr(formulas, "unreadable", lambda name: f"{name}: simulated")
    stage = _block_stage()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mb in (0, 1):
            stage.forward(mb, x)
            stage.backward_input(mb, torch.ones(2, 7, 32) / 2)
            stage.backward_weight(mb)
    slow = [w for w in caught if issubclass(w.category, RuntimeWarning) and "slow path" in str(w.message)]
    assert len(slow) == 1, [str(w.message) for w in caught]
    assert "Block" in str(slow[0].message) and "activation memory" in str(slow[0].message)
    for (n, q), (_, r) in zip(stage.module.named_parameters(), ref.module.named_parameters(), strict=False):
        torch.testing.assert_close(q.grad, r.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_private_autograd_reads_stay_behind_the_one_door():
    """``_saved_*`` and ``_input_metadata`` are read in engine/graph.py and nowhere else in the package."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1] / "lightning_twobp"
    found = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if p.name != "graph.py" and re.search(r"\._saved_|_input_metadata", p.read_text())
    ]
    assert found == [], f"private autograd reads outside engine/graph.py: {found}"
