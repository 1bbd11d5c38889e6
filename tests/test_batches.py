"""Cutting a batch into micro-batches: every container Lightning moves to the device is cut, keeping its type."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from lightning_twobp import TwoBPStrategy
from lightning_twobp.lightning.step import batch_size, join_predictions, split_microbatches
from lightning_twobp.processes import run_distributed

from conftest import Regressor, lightning_env, quiet_trainer, regression_data


class Encoding(collections.UserDict):
    """A Mapping that is not a dict, as Hugging Face's ``BatchEncoding`` (what tokenizers and
    ``DataCollatorWithPadding`` return)."""


@dataclasses.dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor


def _columns(n: int = 8) -> dict[str, torch.Tensor]:
    ids = torch.arange(n * 3).view(n, 3)
    return {"input_ids": ids, "attention_mask": ids % 2 == 0, "labels": torch.randn(n, 2)}


@pytest.mark.parametrize("wrap", [dict, Encoding, lambda d: Batch(**d)], ids=["dict", "mapping", "dataclass"])
def test_a_mapping_or_dataclass_batch_is_cut_and_keeps_its_type(wrap):
    cols = _columns()
    mbs = split_microbatches(wrap(cols), 4)
    assert len(mbs) == 4 and all(type(mb) is type(wrap(cols)) for mb in mbs)
    get = (lambda mb, k: getattr(mb, k)) if dataclasses.is_dataclass(mbs[0]) else (lambda mb, k: mb[k])
    for k, v in cols.items():
        torch.testing.assert_close(torch.cat([get(mb, k) for mb in mbs]), v)
        assert get(mbs[1], k).shape[0] == 2
    assert [batch_size(mb) for mb in split_microbatches(wrap(_columns(6)), 4, exact=False)] == [2, 2, 1, 1]


def test_hugging_face_batch_encoding_is_cut():
    transformers = pytest.importorskip("transformers")
    mbs = split_microbatches(transformers.BatchEncoding(_columns()), 2)
    assert all(isinstance(mb, transformers.BatchEncoding) and mb["input_ids"].shape == (4, 3) for mb in mbs)


def test_a_batch_without_tensors_says_what_it_holds():
    with pytest.raises(ValueError, match=r"found no tensor in a batch of type list"):
        split_microbatches([["a", "b"]], 2)


def test_nested_containers_and_0d_tensors_as_before():
    ids = torch.arange(8)
    mbs = split_microbatches({"x": (ids, [ids * 2]), "t": torch.tensor(2.0), "n": None}, 4)
    assert [mb["x"][1][0].tolist() for mb in mbs] == [[0, 2], [4, 6], [8, 10], [12, 14]]
    assert all(mb["t"].item() == 2.0 and mb["n"] is None and isinstance(mb["x"], tuple) for mb in mbs)


def _evaluate_twice(rank: int, world: int) -> list[float]:
    lightning_env(rank, world)
    model, trainer = Regressor(), quiet_trainer(TwoBPStrategy(), world)
    first = trainer.validate(model, regression_data(16, seed=2), verbose=False)[0]["val_loss"]
    second = trainer.validate(model, regression_data(16, seed=3), verbose=False)[0]["val_loss"]
    return [first, second]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_one_trainer_validates_twice_as_one_process(no_leftover_process_group):
    """Each Trainer call builds new process groups; the data-parallel group a logged value is synced over
    was one of self.log's options, which Lightning keeps per key and compares on the next call:
    'You called self.log(val_loss, ...) twice in validation_step with different arguments'."""
    model, trainer = Regressor(), quiet_trainer()
    ref = [trainer.validate(model, regression_data(16, seed=s), verbose=False)[0]["val_loss"] for s in (2, 3)]
    for got in run_distributed(_evaluate_twice, 2, timeout=240):
        assert got == pytest.approx(ref, rel=1e-5)


def _fit_on_rank_sharded_data(rank: int, world: int) -> str:
    lightning_env(rank, world)
    data = regression_data(32).dataset
    loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=torch.utils.data.DistributedSampler(data))
    try:
        quiet_trainer(TwoBPStrategy(), world, max_steps=2).fit(Regressor(), loader)
    except ValueError as e:
        return str(e)
    return "trained"


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_data_sharded_by_global_rank_is_refused_on_every_rank():
    """DDP code ported as is (the user's own DistributedSampler, over the world size) gave each stage of
    the pipeline other samples: the first stage's inputs trained against another sample's labels on the
    last, without a word. Every rank now refuses the first batch, naming the ranks."""
    for message in run_distributed(_fit_on_rank_sharded_data, 2, timeout=240):
        assert "the ranks of one pipeline read different batches at training batch 0" in message, message
        assert "global ranks [0] / [1]" in message and "DistributedSampler" in message


class _Unsized(torch.utils.data.IterableDataset):
    """Batches without a length: Lightning counts inf training batches."""

    def __iter__(self):
        yield from regression_data(32).dataset


def _loaders_of_different_lengths(rank: int, world: int) -> list[tuple[str, float]]:
    """A training loader of 4 batches on rank 0 and 2 on rank 1, the same first batch on both (as litdata built
    before the launcher set WORLD_SIZE gave one stage 8 batches and the other 4); first the same for validation,
    and an unsized loader on both ranks, which trains."""
    import time

    lightning_env(rank, world)
    said = []
    for how in ("unsized", "validate", "fit"):
        data = torch.utils.data.Subset(regression_data(32).dataset, range(32 if rank == 0 else 16))
        loader = torch.utils.data.DataLoader(_Unsized() if how == "unsized" else data, batch_size=8)
        trainer, start = quiet_trainer(TwoBPStrategy(pipeline_timeout=120), world, max_steps=6), time.monotonic()
        try:
            if how == "validate":
                trainer.validate(Regressor(), loader, verbose=False)
            else:
                trainer.fit(Regressor(), loader)
            said.append(("trained", time.monotonic() - start))
        except ValueError as e:
            said.append((str(e), time.monotonic() - start))
    return said


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_loaders_of_different_lengths_on_a_pipelines_ranks_are_refused_on_every_rank_at_once():
    """Before this check the rank with more batches waited in the step after the other's epoch had ended, for
    pipeline_timeout (600 s by default), then raised a PeerLost that read like a crash."""
    for said in run_distributed(_loaders_of_different_lengths, 2, timeout=240):
        assert said[0][0] == "trained", said[0]
        for (message, seconds), what, where in zip(
            said[1:],
            ["validation loaders (dataloader_idx 0)", "training loaders"],
            ["the first batch of a validation loader", "training batch 0 (global step 0)"],
            strict=True,
        ):
            assert message.startswith(
                f"twobp: the {what} of one pipeline's ranks have different lengths (global rank 0: 4 batches, "
                f"global rank 1: 2 batches; seen at {where}): every stage of a pipeline must read the same batches"
            ), message
            assert "split the data by trainer.strategy.dp_rank" in message.lower()
            assert "_DistributedEnv(trainer.strategy.dp_degree, trainer.strategy.dp_rank, 1)" in message
            assert seconds < 60, f"refused after {seconds:.0f} s: not at once"


def test_a_list_of_one_value_per_sample_is_cut_like_the_tensors():
    """A text batch's strings (or ids) beside its tensors: each micro-batch gets its own samples' entries,
    as its tensors; handed whole to every micro-batch, a count over them read m times the batch's."""
    batch = {"ids": torch.arange(6), "text": list("abcdef"), "tags": ["x", "y"], "pair": [torch.arange(6), 7]}
    mbs = split_microbatches(batch, 4, exact=False)
    assert [mb["text"] for mb in mbs] == [["a", "b"], ["c", "d"], ["e"], ["f"]]
    assert [mb["ids"].tolist() for mb in mbs] == [[0, 1], [2, 3], [4], [5]]
    assert all(mb["tags"] == ["x", "y"] and mb["pair"][1] == 7 for mb in mbs)  # not one per sample: whole
    assert [mb["pair"][0].tolist() for mb in mbs] == [[0, 1], [2, 3], [4], [5]]


def test_predictions_join_as_one_batchs():
    """The inverse of the cut: per-sample tensors and lists joined, containers entry by entry, a value
    every micro-batch returned alike kept once; a per-batch value that differs is refused, naming it."""
    mbs = [
        {
            "logits": torch.full((2, 3), float(i)),
            "text": ["a", "b"][: 2 - (i == 2)],
            "idx": 5,
            "pair": (torch.ones(2), None),
        }
        for i in range(3)
    ]
    joined = join_predictions(mbs)
    assert joined["logits"].shape == (6, 3) and joined["text"] == ["a", "b", "a", "b", "a"]
    assert joined["idx"] == 5 and joined["pair"][1] is None and joined["pair"][0].shape == (6,)
    with pytest.raises(ValueError, match="predict_step returned a Tensor that differs between the micro-batches"):
        join_predictions([torch.tensor(1.0), torch.tensor(2.0)])


def test_a_list_of_one_tensor_per_sample_is_refused_naming_the_fix():
    """predict_step returning `[row for row in out]` was joined as a list of outputs, each micro-batch's rows as
    columns (silently: 2 tensors of 8 where one process has 8 rows); a list of outputs still joins per output."""
    rows = [{"rows": [torch.full((3,), float(2 * i + k)) for k in range(2)]} for i in range(4)]
    with pytest.raises(ValueError, match=r"a list of 2 tensors of shape \(3,\) .* torch.stack the samples' rows"):
        join_predictions(rows, [2, 2, 2, 2])
    outputs = [[torch.zeros(2, 3), torch.ones(2), torch.ones(2, 5)] for _ in range(4)]  # one entry per output
    assert [tuple(t.shape) for t in join_predictions(outputs, [2, 2, 2, 2])] == [(8, 3), (8,), (8, 5)]
    pair = [[torch.zeros(2, 3), torch.full((5,), 7.0)] for _ in range(3)]  # as many outputs as samples: per output
    joined = join_predictions(pair, [2, 2, 2])
    assert joined[0].shape == (6, 3) and torch.equal(joined[1], torch.full((5,), 7.0))


def test_a_hugging_face_model_output_joins_as_one():
    """predict_step returning a ModelOutput: joined, it stays one (it came back a dict, and `out.logits` failed)."""
    outputs = pytest.importorskip("transformers.modeling_outputs", reason="the model output needs transformers")
    mbs = [outputs.CausalLMOutput(logits=torch.full((2, 3), float(i))) for i in range(2)]
    joined = join_predictions(mbs, [2, 2])
    assert isinstance(joined, outputs.CausalLMOutput) and joined.logits.shape == (4, 3)
