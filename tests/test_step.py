"""The step runner's pieces on one process: micro-batch splitting and the one private read."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from lightning_twobp.lightning.step import split_microbatches

from conftest import quiet_trainer


def test_split_is_along_the_first_dimension_and_keeps_the_structure():
    batch = {"x": torch.arange(8).view(4, 2), "y": torch.arange(4), "name": "a"}
    mbs = split_microbatches(batch, 2)
    assert [mb["y"].tolist() for mb in mbs] == [[0, 1], [2, 3]] and mbs[1]["name"] == "a"
    # an iterable loader's smaller last batch meets this check only when it comes: the fix is named
    with pytest.raises(ValueError, match="batch size 4 does not split into 3 micro-batches.*drop_last=True"):
        split_microbatches(batch, 3)
    assert [len(mb["y"]) for mb in split_microbatches(batch, 3, exact=False)] == [2, 1, 1]


def test_the_torchmetrics_private_state_we_set_is_what_lightning_and_torchmetrics_read():
    """Fails loudly when torchmetrics or Lightning change what lightning/metrics.py relies on: Lightning logs a
    Metric's ``_forward_cache`` at a step, ``update_count`` reads ``_update_count``, and ``_reduce_states``
    merges a state before the current one (sums added, concatenated states in order)."""
    import lightning.pytorch as pl
    from torchmetrics import CatMetric, SumMetric

    from lightning_twobp.private import metric_finish_step as _finish_step
    from lightning_twobp.private import metric_merge as _merge

    metric = CatMetric()
    metric.update(torch.tensor([1.0, 2.0]))
    before = {"value": list(metric.value)}  # reset() empties the list in place
    metric.reset()
    metric.update(torch.tensor([3.0]))
    _merge(metric, before)
    _finish_step(metric, 5, torch.tensor(0.25))
    assert metric.compute().tolist() == [1.0, 2.0, 3.0] and metric.update_count == 5
    total = SumMetric()
    total.update(torch.tensor(2.0))
    _merge(total, {"sum_value": torch.tensor(3.0)})
    assert float(total.compute()) == 5.0

    class Logs(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)
            self.total = SumMetric()

        def training_step(self, batch, batch_idx):
            self.total(torch.tensor(1.0))
            _finish_step(self.total, 1, torch.tensor(0.25))
            self.log("total", self.total)
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = quiet_trainer(max_steps=1, use_distributed_sampler=True)
    trainer.fit(Logs(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(2, 2)), batch_size=2))
    assert float(trainer.callback_metrics["total"]) == 0.25


def test_a_steps_metric_state_is_the_whole_batchs_on_every_rank():
    """Without processes: the last stage's step over two micro-batches, and another rank given its states."""
    from torchmetrics.classification import MulticlassAccuracy

    from lightning_twobp.lightning.metrics import StepMetrics

    def module() -> torch.nn.Module:
        m = torch.nn.Module()
        m.acc = MulticlassAccuracy(num_classes=3)  # macro: not a mean over samples
        return m

    preds, target = torch.tensor([0, 1, 2, 2, 1, 0]), torch.tensor([0, 1, 1, 2, 2, 0])
    whole = MulticlassAccuracy(num_classes=3)
    whole(preds[:2], target[:2])
    batch_value = whole(preds[2:], target[2:])
    last, other = module(), module()
    last.acc(preds[:2], target[:2])  # a first step, before the pipeline's
    other.acc(preds[:2], target[:2])
    mine, theirs = StepMetrics(last), StepMetrics(other)
    mine.begin(), theirs.begin()
    last.acc(preds[2:4], target[2:4])
    last.acc(preds[4:], target[4:])
    theirs.apply(mine.end())
    for m in (last.acc, other.acc):
        assert float(m._forward_cache) == float(batch_value)  # the step's value: the whole batch's
        assert float(m.compute()) == float(whole.compute()) and m.update_count == 2


def _micro_steps(module: torch.nn.Module, sizes: list[int], hook: str, call) -> None:
    """``call(i)`` for each micro-batch ``i`` of a step, inside the Metrics' shadows as the step runner
    sets them (a step on the last stage between ``begin`` and ``end``)."""
    from lightning_twobp.lightning.step import shadowed

    metrics = module.twobp_metrics
    metrics.begin()
    for i, n in enumerate(sizes):
        with shadowed(metrics.step_shadows(hook, len(sizes), n / sum(sizes))):
            call(i)
    metrics.end()


def test_one_number_metrics_take_the_batch_as_one_process():
    """A MeanMetric given the step's loss (one number per call, the commonest Metric of all) weighed its
    micro-batches alike, so a validation's smaller last batch cut 2, 2, 1, 1 read 3% off, and a Metric fed by
    training and validation steps weighed each training step m times: each number weighs its micro-batch's
    share now, as self.log's mean does. A ``weight=`` of the step's own and per-sample values stay as they
    are; ``update`` alone leaves no step value (one process logs none); a CatMetric given one number and a
    Running window in a step are refused (they would hold micro-batches); a SumMetric of a float warns."""
    import warnings

    from torchmetrics import CatMetric, MeanMetric, SumMetric
    from torchmetrics.aggregation import RunningMean

    from lightning_twobp.lightning.metrics import StepMetrics

    m = torch.nn.Module()
    m.loss, m.weighted, m.per_sample, m.upd = MeanMetric(), MeanMetric(), MeanMetric(), MeanMetric()
    m.cat, m.total, m.running = CatMetric(), SumMetric(), RunningMean(window=2)
    m.twobp_metrics = StepMetrics(m)
    sizes = [2, 2, 1, 1]  # a validation's last batch of 6 in 4 micro-batches
    per_sample = [torch.tensor(v) for v in ([1.0, 3.0], [2.0, 2.0], [5.0], [4.0])]
    means = [float(v.mean()) for v in per_sample]
    m.running.update(torch.tensor(9.0))  # before the step, outside it: the window's position must survive

    def call(i: int) -> None:
        m.loss(torch.tensor(means[i]))
        m.weighted(torch.tensor(means[i]), weight=sizes[i])
        m.per_sample(per_sample[i])
        m.upd.update(means[i])
        m.total.update(torch.tensor(sizes[i]))  # a count in the integers: exact, no word
        m.cat.update(per_sample[i])

    _micro_steps(m, sizes, "validation_step", call)
    batch = float(torch.cat(per_sample).mean())  # 17 / 6
    assert float(m.loss.compute()) == pytest.approx(batch) and float(m.loss.weight) == pytest.approx(1.0)
    assert float(m.loss._forward_cache) == pytest.approx(batch)  # the step's value, as one process logs it
    assert float(m.weighted.weight) == 6 and float(m.per_sample.weight) == 6
    assert m.upd._forward_cache is None and float(m.upd.compute()) == pytest.approx(batch)
    assert float(m.total.compute()) == 6 and m.cat.compute().shape == (6,)
    m.running.update(torch.tensor(1.0))
    assert float(m.running.compute()) == 5.0  # 9 and 1: the window went on where it was
    with pytest.raises(ValueError, match=r"self.cat \(CatMetric\) was given one number in validation_step .* hold 4"):
        _micro_steps(m, sizes, "validation_step", lambda i: m.cat.update(torch.tensor(means[i])))
    with pytest.raises(ValueError, match=r"self.running \(RunningMean, window=2\) was updated in training_step"):
        _micro_steps(m, sizes, "training_step", lambda i: m.running(torch.tensor(means[i])))
    with pytest.warns(UserWarning, match=r"self.total \(SumMetric\) is given one number .* reads 4x"):
        _micro_steps(m, sizes, "training_step", lambda i: m.total.update(torch.tensor(means[i])))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once a Trainer call
        _micro_steps(m, sizes, "training_step", lambda i: m.total.update(torch.tensor(means[i])))


def test_wrapped_and_tracked_metrics_as_one_process_on_every_rank():
    """torchmetrics' wrappers under the step's set-aside-and-merge, against one process's updates over whole
    batches, on the last stage and on another rank given its states (found by a trial, each silently off
    before): a ClasswiseWrapper (its states are its metric's: merged twice, counts 10x), a MinMaxMetric (its
    reset emptied the metric it wraps, which had the step's state: 0.0), a MetricTracker (the copy each
    ``increment()`` adds was unknown to the step: only the last stage's rank counted), a MetricCollection
    with compute groups; and a Metric deep-copied during the call (MetricTracker, ``clone``, SWA: torch
    "cannot pickle 'ProcessGroup'" where the data-parallel group sat in ``process_group``)."""
    import copy

    import torchmetrics as tm
    from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score, MulticlassPrecision

    from lightning_twobp.lightning.metrics import StepMetrics

    def module() -> torch.nn.Module:
        m = torch.nn.Module()
        m.cw = tm.wrappers.ClasswiseWrapper(MulticlassAccuracy(4, average=None))
        m.mm = tm.wrappers.MinMaxMetric(MulticlassAccuracy(4))
        m.tracker = tm.wrappers.MetricTracker(MulticlassAccuracy(4))
        m.coll = tm.MetricCollection([MulticlassPrecision(4), MulticlassF1Score(4)], compute_groups=True)
        return m

    def update(m: torch.nn.Module, p: torch.Tensor, t: torch.Tensor) -> None:
        for name in ("cw", "mm", "tracker", "coll"):
            getattr(m, name).update(p, t)

    g = torch.Generator().manual_seed(0)
    steps = [(torch.randn(8, 4, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(3)]
    one, last, other = module(), module(), module()
    mine, theirs = StepMetrics(last), StepMetrics(other)
    undo = [mine.sync_over(None), theirs.sync_over(None)]
    for k, (p, t) in enumerate(steps):
        for m in (one, last, other):
            if k != 1:  # an epoch of one step, then one of two
                m.tracker.increment()
        update(one, p, t)
        mine.begin(), theirs.begin()
        for i in range(4):
            update(last, p[2 * i : 2 * i + 2], t[2 * i : 2 * i + 2])
        theirs.apply(mine.end())
    for m in (last, other):
        for name in ("cw", "mm", "coll"):
            got, want = getattr(m, name).compute(), getattr(one, name).compute()
            assert {k: float(v) for k, v in got.items()} == {k: float(v) for k, v in want.items()}, name
        assert [float(v) for v in m.tracker.compute_all()] == [float(v) for v in one.tracker.compute_all()]
        copy.deepcopy(m)  # a deep copy during the call
    from lightning_twobp.lightning.step import shadowed

    # called (forward) in a step, a MinMaxMetric would keep the micro-batches' extremes: refused
    shadows = mine.step_shadows("training_step", 4, 0.25)
    with shadowed(shadows), pytest.raises(ValueError, match=r"self.mm \(MinMaxMetric\) was called in training_step"):
        last.mm(*steps[0])
    for u in undo:
        u()
    assert last.cw.metric.dist_sync_fn is None and last.tracker[-1].dist_sync_fn is None  # back after the call


def test_a_steps_self_log_of_another_stages_weight_is_refused_naming_the_layer():
    """The step's code after the pipelined call runs on the last stage, where another stage's layers are
    placeholders: ``self.log("w0", self.layers[0].weight.abs().mean())`` in a validation step stored the
    placeholder, which every rank then logged, and the run failed later wherever a logger or the progress bar read
    it, with a message about control flow between blocks (found by the Lightning trial). It is refused at the
    ``self.log``, naming the layer and where to log it instead."""
    from lightning_twobp.lightning.metrics import StepMetrics
    from lightning_twobp.lightning.placeholders import ElsewhereError, elsewhere
    from lightning_twobp.lightning.step import _LogRecorder

    store: dict = {}
    recorder = _LogRecorder(store, StepMetrics(torch.nn.Module()), "validation_step", 4)
    recorder("loss", torch.tensor(0.5))
    weight = elsewhere(torch.ones(3, 2), "layers[0].weight (pipeline stage 0)")
    with pytest.raises(ElsewhereError, match=r"self.log\('w0', ...\) from a step .* computed by layers\[0\].weight"):
        recorder("w0", weight.abs().mean())
    assert list(store) == ["loss"]


def test_a_floating_value_logged_with_sum_max_or_min_is_told_once_a_call():
    """``self.log("loss_max", loss, reduce_fx="max")`` logs the micro-batches' largest mean, not the batch's mean
    (found by a trial: 2.56 against one process's 1.60, silently). Said once per name and Trainer call; a count,
    a mean and a step of one micro-batch are exact and say nothing."""
    from lightning_twobp.lightning.metrics import StepMetrics
    from lightning_twobp.lightning.step import _LogRecorder

    metrics = StepMetrics(torch.nn.Module())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # three micro-batches, then another step's
            recorder = _LogRecorder({}, metrics, "training_step", 4)
            recorder("loss_max", torch.tensor(0.5), reduce_fx="max")
            recorder("tokens", torch.tensor(7), reduce_fx="sum")
            recorder("loss", torch.tensor(0.5))
            _LogRecorder({}, StepMetrics(torch.nn.Module()), "training_step", 1)("one", 0.5, reduce_fx="sum")
    said = [str(w.message) for w in caught]
    assert len(said) == 1, said
    assert re.search(r"self.log\('loss_max', ..., reduce_fx='max'\) in training_step.* 4 values' max.*"
                     r"on_train_batch_end \(outputs\['loss'\]", said[0]), said[0]  # fmt: skip


def test_a_step_iterating_the_parameters_of_a_split_model_to_the_end_is_refused():
    """On each rank ``self.parameters()`` yields that rank's stages' parameters only: an L2 penalty over them in
    the step (``loss + c * sum(p.pow(2).sum() for p in self.parameters())``) trained silently differently from
    one process (found by a trial: 0.0024 off after 3 steps). While the step runs, iterating the parameters of a
    module that holds a placeholder (or of a placeholder) to the end raises, naming the module and the fixes;
    reads that stop early, ``recurse=False`` and everything outside the step are left alone."""
    from torch import nn

    from lightning_twobp.lightning.local_model import _Remote
    from lightning_twobp.lightning.placeholders import ElsewhereError
    from lightning_twobp.lightning.step import _no_whole_model_reads, placeholder_holders, shadowed

    lm = nn.Module()
    lm.head = nn.Linear(2, 1)
    lm.layers = nn.Sequential(nn.Linear(2, 2), _Remote(1, 1, [nn.Linear(2, 2)], torch.device("cpu"), "layers[1]"))
    with shadowed(_no_whole_model_reads(placeholder_holders(lm), "training_step")):
        with pytest.raises(ElsewhereError, match=r"training_step iterated self.parameters\(\) .*weight_decay=2\*c"):
            sum(p.pow(2).sum() for p in lm.parameters())
        with pytest.raises(ElsewhereError, match=r"iterated self.layers.parameters\(\)"):
            dict(lm.layers.named_parameters())
        with pytest.raises(ElsewhereError, match=r"iterated self.layers.1.parameters\(\)"):
            list(lm.layers[1].parameters())  # a placeholder has none: a penalty of it was 0
        assert next(lm.parameters()).device.type == "cpu"  # stops early: no refusal
        assert len(list(lm.layers[0].parameters())) == 2 and list(lm.parameters(recurse=False)) == []
        assert len(list(lm.head.parameters())) == 2  # a module without placeholders
    assert len(list(lm.parameters())) == 4 and all("named_parameters" not in m.__dict__ for m in lm.modules())
