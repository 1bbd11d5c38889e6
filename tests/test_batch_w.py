"""Batched W as a user option (issue 21, item 3): ``TwoBPStrategy(batch_w=...)`` reaches every Stage the
executor builds, joins the W of several micro-batches into one call per weight where the schedule runs
them together (GPipe, 1F1B, interleaved 1F1B), and trains as one process does.

Not bit-equal, so checked at fp32 rtol 1e-5: the joined call sums every micro-batch's rows in one
reduction (one GEMM over the concatenated gradients and inputs), where the reference adds each
micro-batch's own sum into ``.grad`` in turn; fp32 addition in another order rounds differently
(about 1e-7 of a gradient's largest value). That the joined path ran is counted, not assumed:
``formulas.batched`` (the one place micro-batches are joined) is wrapped and its calls counted, and
the same run with the option off counts none.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from lightning_twobp import TwoBPStrategy
from lightning_twobp.engine import PipelineExecutor, formulas
from lightning_twobp.models.llama import LlamaConfig, build_llama
from lightning_twobp.options import PipelineOptions
from lightning_twobp.partition import even_sizes, split_sequential
from lightning_twobp.schedules import build_schedule
from lightning_twobp.schedules.auto import Candidate

import conftest
from conftest import Regressor, launch, lightning_env, quiet_trainer, regression_data

VOCAB, SEQ, MB_SIZE, M = 32, 8, 2, 4


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(batch_w="yes"), r"batch_w='yes'\): use False \(off, the default\), True .* or an int"),
        (dict(batch_w=-1), r"batch_w=-1\): use False"),
        (dict(batch_w=1.5), r"batch_w=1.5\): use False"),
        (dict(batch_w=True, split_backward=False), r"with split_backward=False runs fused BW and has none"),
        (dict(batch_w=True, schedule="zb-h1"), r"schedule='zb-h1' at num_microbatches=4 runs each micro-batch's W"),
        (dict(batch_w=True, schedule="zb-v"), r"'gpipe', '1f1b' or 'interleaved-1f1b'"),
        (dict(batch_w=True, max_pending_w=0), r"schedule='1f1b' with max_pending_w=0 at num_microbatches=4"),
        (dict(batch_w=4096, num_microbatches=1), r"at num_microbatches=1 runs each micro-batch's W on its own"),
    ],
)
def test_bad_batch_w_is_refused_at_construction(kw, message):
    with pytest.raises(ValueError, match=message):
        TwoBPStrategy(**kw)


def test_batch_w_values_and_the_default_size_named_in_the_message():
    assert PipelineOptions().batch_w is False
    for value in (True, False, 0, 1, 1 << 20):
        assert PipelineOptions(batch_w=value, schedule="gpipe").batch_w == value
    # options.py imports no torch, so its message names the engine's default size in words
    assert formulas.BATCH_BYTES == 512 * 1024


def test_auto_keeps_batch_w_only_where_its_choice_runs_w_together():
    opts = PipelineOptions(schedule="auto", memory_limit="1f1b", batch_w=True)

    def choice(name: str) -> Candidate:
        sched = build_schedule(name, 2, M)
        return Candidate(name, True, M, 1, None, 1.0, (0.0, 0.0), sched, None)  # type: ignore[arg-type]

    assert opts.chosen(choice("1f1b")).batch_w is True
    assert opts.chosen(choice("zb-h1")).batch_w is False  # it runs every W alone: nothing to join
    assert dataclasses.replace(opts, batch_w=False).chosen(choice("gpipe")).batch_w is False


# ---------------------------------------------------------------------------------------------- the executor
def _loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _executor_case(rank: int, world: int, name: str, spr: int, batch_w: bool | int) -> dict:
    """One step of ``name`` on the tiny LLaMa against one process: failures, and the sizes of the joins
    this rank made (``formulas.batched``'s entries per call)."""
    num_stages = world * spr
    torch.manual_seed(0)
    model = build_llama(LlamaConfig(vocab_size=VOCAB, dim=16, n_layers=num_stages, n_heads=2, max_seq_len=SEQ))
    ref = copy.deepcopy(model)
    ids, tgt = torch.randint(0, VOCAB, (M, MB_SIZE, SEQ)), torch.randint(0, VOCAB, (M, MB_SIZE, SEQ))
    ref_loss = sum(_loss(ref(ids[i]), tgt[i]) for i in range(M)) / M
    ref_loss.backward()
    sched = build_schedule(name, num_stages, M, stages_per_rank=spr)
    parts = split_sequential(model, even_sizes(len(model), num_stages))
    mine = {s: parts[s] for s in sched.stages_of(rank)}
    ex = PipelineExecutor(sched, mine, loss_fn=_loss, batch_w=batch_w)
    limit = formulas.BATCH_BYTES if batch_w is True else int(batch_w)
    failures = [
        f"stage {s}: batch_w_bytes {st.batch_w_bytes} != {limit}"
        for s, st in ex.stages.items()
        if st.batch_w_bytes != limit
    ]
    with mock.patch.object(formulas, "batched", wraps=formulas.batched) as joined:
        res = ex.step(list(ids) if 0 in mine else None, list(tgt) if num_stages - 1 in mine else None)
    if num_stages - 1 in mine and not torch.allclose(res.loss, ref_loss.detach(), rtol=1e-5, atol=0):
        failures.append(f"loss {res.loss.item()} != {ref_loss.item()}")
    owned = {id(q) for mod in mine.values() for q in mod.parameters()}
    for (n, q), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if id(q) in owned and (q.grad is None or not torch.allclose(q.grad, r.grad, rtol=1e-5, atol=1e-7)):
            failures.append(f"grad of {n}: " + ("missing" if q.grad is None else f"{(q.grad - r.grad).abs().max()}"))
    return {"failures": failures, "joins": [len(c.args[0]) for c in joined.call_args_list]}


EXECUTOR = [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2)]


@pytest.mark.dist
@pytest.mark.parametrize("name, spr", EXECUTOR)
def test_joined_w_matches_one_process_and_is_taken(two_ranks, request, name, spr):
    on, small, off = zip(*two_ranks[request.node.name], strict=True)  # per limit, each rank's result
    assert not [f for r in (*on, *small, *off) for f in r["failures"]]
    # the last stage's rank runs every micro-batch's W at the end of the step: all M of them joined
    assert max(n for r in on for n in r["joins"]) == M, [r["joins"] for r in on]
    # a limit below every micro-batch's gradient joins nothing, and so does the option off
    assert not [r["joins"] for r in (*small, *off) if r["joins"]]


def _each_limit(rank: int, world: int, name: str, spr: int) -> list[dict]:
    return [_executor_case(rank, world, name, spr, b) for b in (True, 1, False)]


def _alone_warns(rank: int, world: int) -> list[str]:
    """An executor given batch_w on a schedule that runs each W alone says nothing is joined."""
    torch.manual_seed(0)
    model = build_llama(LlamaConfig(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, max_seq_len=SEQ))
    sched = build_schedule("zb-h1", 2, M)
    parts = split_sequential(model, even_sizes(len(model), 2))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        PipelineExecutor(sched, {rank: parts[rank]}, loss_fn=_loss, batch_w=True)
    return [str(w.message) for w in seen]


@pytest.mark.dist
def test_an_executor_with_nothing_to_join_says_so(two_ranks):
    for seen in two_ranks["test_an_executor_with_nothing_to_join_says_so"]:
        assert any("zb-h1 runs each W alone here; nothing is joined" in s for s in seen), seen


# ---------------------------------------------------------------------------------------------- the strategy
class _Grads(pl.Callback):
    """The loss and this rank's gradients right before the first optimizer step."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        self.loss = float("nan")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 0:
            self.grads = {n: q.grad.clone() for n, q in pl_module.named_parameters() if q.grad is not None}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 1:
            self.loss = float(outputs["loss"])


def _fit(rank: int, world: int, schedule: str, batch_w: bool | int) -> dict:
    """One step of the Regressor through the Trainer with ``TwoBPStrategy(batch_w=...)``: the loss, the
    gradients and the joins this rank made."""
    lightning_env(rank, world)
    model, grads = Regressor(), _Grads()
    strategy = TwoBPStrategy(schedule=schedule, num_microbatches=M, batch_w=batch_w)
    trainer = quiet_trainer(strategy, world, max_steps=1, callbacks=[grads], num_sanity_val_steps=0)
    with mock.patch.object(formulas, "batched", wraps=formulas.batched) as joined:
        trainer.fit(model, regression_data())
    return {"loss": grads.loss, "grads": grads.grads, "joins": [len(c.args[0]) for c in joined.call_args_list]}


def _one_process() -> tuple[float, dict[str, torch.Tensor]]:
    """The Regressor's first batch in one process: the mean of the micro-batches' losses is the batch's."""
    model = Regressor()
    x, y = next(iter(regression_data()))
    loss = F.mse_loss(model.layers(x), y)
    loss.backward()
    return loss.item(), {n: q.grad for n, q in model.named_parameters()}


@pytest.mark.dist
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_strategy_option_joins_w_and_trains_as_one_process(two_ranks, request, schedule):
    on, off = zip(*two_ranks[request.node.name], strict=True)  # per setting, each rank's result
    ref_loss, ref = _one_process()
    for results in (on, off):
        assert all(r["loss"] == pytest.approx(ref_loss, rel=1e-5) for r in results)
        grads = {n: g for r in results for n, g in r["grads"].items()}
        assert set(grads) == set(ref)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref[n], rtol=1e-5, atol=1e-7, msg=n)
    # stage 1 (the last) joins its M micro-batches' W; stage 0 (fed data, no input gradient) has no W
    assert [max(r["joins"], default=0) for r in on] == [0, M]
    assert [r["joins"] for r in off] == [[], []]


def _fit_sharded(rank: int, world: int) -> dict:
    """pp 2 x dp 2 under data_parallel="shard" (FSDP2's gathered parameters are what W writes into):
    the gradients gathered from the shards; both replicas read the same batches (no distributed sampler)."""
    lightning_env(rank, world)
    model, grads = Regressor(), _Grads()
    strategy = TwoBPStrategy(pipeline_degree=2, num_microbatches=M, batch_w=True, data_parallel="shard")
    trainer = quiet_trainer(strategy, world, max_steps=1, callbacks=[grads], num_sanity_val_steps=0)
    with mock.patch.object(formulas, "batched", wraps=formulas.batched) as joined:
        trainer.fit(model, regression_data())
    full = {n: g.full_tensor() for n, g in grads.grads.items()}  # DTensor shards: every rank calls it
    return {"loss": grads.loss, "grads": full, "joins": [len(c.args[0]) for c in joined.call_args_list]}


@pytest.mark.dist
def test_joined_w_under_sharded_data_parallel_trains_as_one_process(request):
    results = launch(request, 4, {request.node.name: (_fit_sharded, ())}, timeout=600)[request.node.name]
    ref_loss, ref = _one_process()
    for r in results:
        assert r["loss"] == pytest.approx(ref_loss, rel=1e-5)
        for n, g in r["grads"].items():
            torch.testing.assert_close(g, ref[n], rtol=1e-5, atol=1e-7, msg=n)
    held = {n for r in results for n in r["grads"]}
    assert held == set(ref)
    # ranks 0 and 2 hold stage 0 (no W), ranks 1 and 3 the last stage: each joins its 4 micro-batches
    assert [max(r["joins"], default=0) for r in results] == [0, M, 0, M]


def _fit_on_and_off(rank: int, world: int, schedule: str) -> list[dict]:
    return [_fit(rank, world, schedule, b) for b in (True, False)]


@pytest.fixture(scope="module")
def two_ranks(request) -> conftest.Launch:
    """Every case of this module in one launch of 2 ranks."""
    cases = {
        f"test_joined_w_matches_one_process_and_is_taken[{n}-{spr}]": (_each_limit, (n, spr)) for n, spr in EXECUTOR
    }
    cases["test_an_executor_with_nothing_to_join_says_so"] = (_alone_warns, ())
    cases |= {
        f"test_the_strategy_option_joins_w_and_trains_as_one_process[{s}]": (_fit_on_and_off, (s,))
        for s in ("1f1b", "gpipe")
    }
    return launch(request, 2, cases, timeout=840)
