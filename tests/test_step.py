"""The step runner's pieces on one process: micro-batch splitting and the one private read."""

from __future__ import annotations

import pytest
import torch

from lightning_twobp.lightning.step import metric_batch_value, split_microbatches


def test_split_is_along_the_first_dimension_and_keeps_the_structure():
    batch = {"x": torch.arange(8).view(4, 2), "y": torch.arange(4), "name": "a"}
    mbs = split_microbatches(batch, 2)
    assert [mb["y"].tolist() for mb in mbs] == [[0, 1], [2, 3]] and mbs[1]["name"] == "a"
    with pytest.raises(ValueError, match="batch size 4 does not split into 3 micro-batches"):
        split_microbatches(batch, 3)
    assert [len(mb["y"]) for mb in split_microbatches(batch, 3, exact=False)] == [2, 1, 1]


def test_a_metrics_batch_value_is_where_lightning_reads_it():
    """Fails loudly when torchmetrics stops keeping the last call's value where Lightning reads it."""
    from torchmetrics.classification import MulticlassAccuracy

    metric = MulticlassAccuracy(num_classes=3, average="micro")
    with pytest.raises(TypeError, match="call it first"):
        metric_batch_value(metric, "acc")
    value = metric(torch.tensor([0, 1, 2, 2]), torch.tensor([0, 1, 1, 2]))
    assert torch.equal(metric_batch_value(metric, "acc"), value) and float(value) == 0.75
