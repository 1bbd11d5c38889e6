"""schedule="auto" (issue 20.4): the search as data, then the strategy on 2 ranks against one process."""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from collections.abc import Callable

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_twobp.engine.footprint import StepMeter, storage_key
from lightning_twobp.schedules import build_schedule, schedule_spec, simulate
from lightning_twobp.schedules.auto import (
    LayerCost,
    NoScheduleFits,
    Profile,
    check_families,
    choose,
    choose_profiles,
    format_choice,
    resolve_limit,
    search,
    stage_cost,
)
from lightning_twobp.schedules.memory import SIGNATURE_BYTES

import conftest
from conftest import Regressor, launch, lightning_env, quiet_trainer

# ------------------------------------------------------------------ the search, as data

LAYERS = 8


def _profile(p: int = 2, w: float = 1.0, counts=(2, 4, 8)) -> Profile:
    """Equal layers whose bytes per micro-batch shrink with its size (batch 8 split in m) and whose
    time does too, less a fixed cost per action: more micro-batches hold less but are not free."""

    def at(m: int) -> tuple[LayerCost, ...]:
        s = 8 / m
        return tuple(
            LayerCost(f=s + 0.5, b=s + 0.5, w=w * s + 0.5, activation=100 * s, held=40 * s, fixed=1000)
            for _ in range(LAYERS)
        )

    return Profile(
        num_ranks=p,
        layers={m: at(m) for m in counts},
        partitions={1: (LAYERS // p,) * p, 2: (LAYERS // (2 * p),) * (2 * p)},
        comm={m: 0.0 for m in counts},
    )


def test_stage_cost_counts_shared_tensors_once_and_the_first_stage_holds_nothing():
    relu = LayerCost(f=1, b=1, w=0, activation=10, saves_output=True)
    linear = LayerCost(f=2, b=2, w=2, activation=10, held=10, saved_input=10, fixed=5)
    mid = stage_cost([relu, linear], first=False)
    assert (mid.activation, mid.held, mid.fixed) == (10, 10, 5)  # the ReLU's output is the Linear's input
    assert (mid.f, mid.b, mid.w) == (3, 3, 2)
    first = stage_cost([relu, linear], first=True)
    assert (first.b, first.w, first.held) == (5, 0, 0)  # no input gradient: the whole backward is B
    kept = stage_cost([LayerCost(activation=7, held=1, graph_kept=True)], first=False)
    assert kept.held == 8  # W re-enters the graph: the stage's whole activation stays until W
    # a loss's scalar in a larger buffer (CPU's mse_loss): the buffer is held until B, a message is its size
    loss = stage_cost([LayerCost(activation=3, output=4, output_held=256)], first=False)
    assert (loss.output_kept, loss.activation, loss.message) == (256, 259, 4)


def test_profile_costs_feed_the_simulator():
    prof = _profile()
    costs = prof.costs(4, 1)
    schedule = build_schedule("1f1b", 2, 4, split_backward=False)
    # fused 1F1B at m = p = 2 ranks... rank 0 holds min(p, m) = 2 micro-batches of 4 layers x 200 bytes, and
    # the step's signature it sends rank 1 (the other rank only receives it, before any compute)
    peaks = simulate(schedule, costs).peak_bytes
    assert peaks[0] == 4 * 1000 + 2 * 4 * 200 + SIGNATURE_BYTES
    assert peaks[1] == 4 * 1000 + 4 * 200


def test_a_check_after_the_step_holds_its_bytes_where_the_schedule_checks_so():
    """Post-validation holds each layer's ``checked`` bytes (the step's gradients, and with a possible rollback a
    copy of the weights and optimizer state) through the next step: on the families that check after the step
    by default (ScheduleSpec.overlaps: zb-h2, zb-v), on all of them where the user turns it on, on none off."""
    from dataclasses import replace

    prof = _profile()
    checked = replace(prof, layers={m: tuple(replace(c, checked=7.0) for c in rows) for m, rows in prof.layers.items()})
    plain = {(c.name, c.num_microbatches, c.max_pending_w, c.split_backward): c for c in search(prof)}
    for after, overlapping in ((None, None), (True, True), (False, False)):
        for c in search(replace(checked, checked_after=after)):
            key = (c.name, c.num_microbatches, c.max_pending_w, c.split_backward)
            counts = schedule_spec(c.name).overlaps if overlapping is None else overlapping
            layers = [LAYERS // len(c.schedule.stage_to_rank) * len(c.schedule.stages_of(r)) for r in range(2)]
            want = tuple(p + (7.0 * n if counts else 0.0) for p, n in zip(plain[key].peak_bytes, layers, strict=True))
            assert c.peak_bytes == want, (after, key)
    assert any(schedule_spec(c.name).overlaps for c in search(prof)), "zb-h2 or zb-v must be among the searched"


def test_search_picks_the_fastest_that_fits():
    prof = _profile()
    candidates = search(prof)
    loose = choose(candidates, limit=float("inf"))
    assert loose.best.step_time == min(c.step_time for c in candidates)
    # a limit just under the fastest's peak: the fastest among those within it
    limit = max(c.peak for c in candidates if c.peak < loose.best.peak)
    tight = choose(candidates, limit)
    assert tight.best.peak <= limit < loose.best.peak
    assert tight.best.step_time == min(c.step_time for c in candidates if c.peak <= limit)
    assert tight.best.step_time >= loose.best.step_time
    text = format_choice(tight)
    assert tight.best.label in text and "rank 1:" in text


def test_search_covers_families_microbatches_and_caps():
    candidates = search(_profile())
    names = {c.name for c in candidates}
    assert {"1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min"} <= names
    assert {c.num_microbatches for c in candidates} == {2, 4, 8}
    assert any(c.max_pending_w is not None for c in candidates)
    assert any(not c.split_backward for c in candidates)
    assert all(c.split_backward for c in candidates if c.name == "zb-v")
    # a cap that changes nothing is not listed twice: every (name, split, m) order is distinct
    keys = [(c.name, c.split_backward, c.num_microbatches, c.schedule.actions) for c in candidates]
    assert len(keys) == len(set(keys))


def test_auto_schedules_restrict_the_choice_and_are_named():
    """``auto_schedules``: the choice among those schedules only (each still at its best m, cap and split, and
    fused where the split loses), said in the announcement and in a refusal; none built: refused with why."""
    prof = _profile()
    free = choose(search(prof), float("inf")).best
    among = ("zb-h1", "1f1b") if free.name not in ("zb-h1", "1f1b") else ("zb-h2", "v-min")
    choice, _ = choose_profiles(lambda mode: prof, (None,), lambda first: float("inf"), families=among)
    assert choice.best.name in among and {c.name for c in choice.considered} == set(among)
    assert format_choice(choice, families=among).startswith(f"schedule='auto' among {', '.join(among)}: ")
    smallest = min(c.peak for c in search(prof, families=among))
    with pytest.raises(
        NoScheduleFits,
        match=rf"^schedule='auto' among \['{among[0]}', '{among[1]}'\]: memory_limit=.*"
        r"or add schedules to auto_schedules \(or drop it",
    ):
        choose_profiles(lambda mode: prof, (None,), lambda first: smallest - 1, families=among)
    # interleaved 1F1B needs m to be a multiple of p: at m = 3 on 2 ranks nothing of the list is left
    odd = dataclasses.replace(prof, layers={3: prof.layers[2]}, comm={3: 0.0})
    with pytest.raises(
        ValueError, match=r"among \['interleaved-1f1b'\] has no candidate \(interleaved-1f1b: refuses m = 3"
    ):
        choose_profiles(lambda mode: odd, (None,), lambda first: float("inf"), families=("interleaved-1f1b",))


def test_auto_schedules_that_cannot_run_are_said_before_profiling():
    """check_families, before anything is profiled: a V needs two stages per rank (3 layers on 2 ranks are
    too few; a balance list cuts another number); interleaved 1F1B refuses an odd count. None of the list can
    run: refused, naming those that would (not interleaved 1F1B itself; no split-only one without the split).
    Some can: the others are returned, with why, to be said."""
    with pytest.raises(ValueError, match=r"zb-v needs 4 stages on 2 ranks, and the pipeline has 3 layers; v-min "):
        check_families(("zb-v", "v-min"), 3, 2)
    with pytest.raises(ValueError, match=r"zb-v needs 4 stages on 2 ranks, and balance=\[4, 4\] cuts 2\. "):
        check_families(("zb-v",), 8, 2, balance=(4, 4))
    with pytest.raises(ValueError, match=r"interleaved-1f1b refuses m = 3, 5 \(.*\)\. Add one of gpipe, 1f1b, zb-h1,"):
        check_families(("interleaved-1f1b",), 8, 2, [3, 5])
    with pytest.raises(ValueError, match=r"\)\. Add one of gpipe, 1f1b, or change"):
        check_families(("interleaved-1f1b",), 8, 2, [3, 5], split_backward=False)
    assert set(check_families(("zb-v", "1f1b"), 3, 2)) == {"zb-v"}
    assert check_families(("interleaved-1f1b",), 8, 2, [3, 4]) == {}
    assert check_families(None, 1, 2) == {}


def test_a_cap_is_chosen_when_it_is_what_fits():
    # W as long as F + B: uncapped 1F1B + 2BP is fastest but holds every W; the limit fits a cap only
    prof = _profile(w=2.0, counts=(8,))
    candidates = search(prof, families=["1f1b"])
    uncapped = next(c for c in candidates if c.split_backward and c.max_pending_w is None)
    fused = next(c for c in candidates if not c.split_backward)
    capped = [c for c in candidates if c.max_pending_w is not None and c.peak < uncapped.peak]
    assert capped and fused.peak < uncapped.peak
    best = choose(candidates, max(c.peak for c in capped)).best
    assert best.max_pending_w is not None and best.step_time <= fused.step_time


def test_a_limit_nothing_fits_is_refused_naming_the_smallest_peak():
    candidates = search(_profile())
    smallest = min(c.peak for c in candidates)
    with pytest.raises(NoScheduleFits, match=rf"smallest predicted peak is {smallest:.0f} bytes") as info:
        choose(candidates, smallest - 1)
    assert f"at least {smallest:.0f} bytes" in str(info.value)
    assert info.value.smallest.peak == smallest
    assert choose(candidates, smallest).best.peak == smallest  # exactly the smallest fits


def test_optimizer_state_is_fixed_and_named_when_nothing_fits():
    prof = _profile()
    heavy = dataclasses.replace(
        prof, layers={m: tuple(dataclasses.replace(c, optimizer=500) for c in rows) for m, rows in prof.layers.items()}
    )
    assert stage_cost(heavy.layers[8][:4], first=False).fixed == 4 * (1000 + 500)
    light, loaded = search(prof, families=["1f1b"]), search(heavy, families=["1f1b"])
    for a, b in zip(light, loaded, strict=True):  # the same orders, each rank 4 layers x 500 bytes heavier
        assert b.optimizer_bytes == (2000.0, 2000.0) and a.optimizer_bytes == (0.0, 0.0)
        assert [y - x for x, y in zip(a.peak_bytes, b.peak_bytes, strict=True)] == [2000.0, 2000.0]
    limit = min(c.peak for c in light)  # fits without the optimizer's state, not with it
    with pytest.raises(NoScheduleFits, match="of which 2000 bytes .* optimizer state on rank"):
        choose(loaded, limit)
    assert "optimizer state" in format_choice(choose(loaded, float("inf")))


def test_the_loss_joins_the_last_stage():
    prof = _profile(counts=(4,))
    loss = LayerCost(f=1, b=1, activation=64, saved_input=0)
    with_loss = dataclasses.replace(prof, loss={4: loss})
    plain, lossy = prof.stages(4, 1), with_loss.stages(4, 1)
    assert lossy[0] == plain[0]
    assert lossy[-1].activation == plain[-1].activation + 64 and lossy[-1].f == plain[-1].f + 1


# ------------------------------------------------------------------ data_parallel="shard"


def _linears(n: int = 4, width: int = 32) -> tuple[list[nn.Module], list[LayerCost]]:
    """``n`` Linear layers and their costs as a replicated stage counts them: weights and gradients fixed,
    AdamW's two moments and step counters as the optimizer's state; 1 s and 100 bytes a micro-batch."""
    from lightning_twobp.lightning.autoschedule import optimizer_state_bytes

    torch.manual_seed(0)
    layers = [nn.Linear(width, width) for _ in range(n)]
    state, _ = optimizer_state_bytes([torch.optim.AdamW(nn.Sequential(*layers).parameters())])
    costs = []
    for layer in layers:
        weight = sum(q.numel() * q.element_size() for q in layer.parameters())
        opt = sum(state[id(q)] for q in layer.parameters())
        costs.append(LayerCost(f=1, b=1, w=1, activation=100, held=40, fixed=2.0 * weight, optimizer=opt))
    return layers, costs


@pytest.mark.parametrize("precision, gathered", [("32-true", 4), ("bf16-mixed", 2)])
def test_a_sharded_stage_is_counted_as_the_planner_counts_it(precision, gathered):
    from lightning_twobp.lightning.autoschedule import sharded_fixed
    from lightning_twobp.lightning.sharding import sharded_static_bytes

    layers, costs = _linears()
    params = sum(q.numel() for layer in layers for q in layer.parameters())
    weight = sum(c.fixed for c in costs) / 2
    state = sum(c.optimizer for c in costs)
    replicated = stage_cost(costs, first=False)
    assert replicated.fixed == 2 * weight + state  # 16 bytes a parameter (and AdamW's step counters)
    for dp in (2, 4, 8):
        sharded = stage_cost(
            [sharded_fixed(c, q, dp, precision) for c, q in zip(costs, layers, strict=True)], first=False
        )
        # 1/dp of weights, gradients and optimizer state, plus a step's gathered weights and full gradients
        assert sharded.fixed == sharded_static_bytes(params, int(weight), int(weight), int(state), dp, precision)
        assert sharded.fixed == (2 * weight + state) / dp + 2 * params * gathered
        assert sharded.optimizer == state / dp  # the optimizer's share, still named apart in a refusal
    # fp32 AdamW: 16 / dp + 8 bytes a parameter, so nothing saved at dp = 2 and a quarter at dp = 4
    four = stage_cost([sharded_fixed(c, q, 4, "32-true") for c, q in zip(costs, layers, strict=True)], first=False)
    assert four.fixed == pytest.approx(0.75 * replicated.fixed, rel=1e-3)


def test_a_frozen_weight_of_a_sharded_stage_is_gathered_without_a_gradient():
    from lightning_twobp.lightning.autoschedule import sharded_fixed

    frozen = nn.Linear(8, 8)
    frozen.requires_grad_(False)
    sharded = sharded_fixed(LayerCost(fixed=72 * 4), frozen, 2, "32-true")
    assert sharded.fixed == 72 * 4 / 2 + 72 * 4  # a half of the weight held, all of it gathered; no gradient
    # a bf16 base under an fp32 adapter (FSDP2 wants one dtype among the trained ones only): each as stored
    base, adapter = nn.Linear(64, 64, bias=False).to(torch.bfloat16).requires_grad_(False), nn.Linear(64, 4)
    both = nn.ModuleList([base, adapter])
    w_base, w_adapter = 64 * 64 * 2, (64 * 4 + 4) * 4
    expected = (w_base + w_adapter) / 2 + w_adapter / 2 + w_base + 2 * w_adapter
    assert sharded_fixed(LayerCost(fixed=0), both, 2, "32-true").fixed == expected


def test_a_limit_that_only_a_sharded_stage_fits_picks_a_schedule():
    from lightning_twobp.lightning.autoschedule import sharded_fixed

    layers, costs = _linears()
    sharded = [sharded_fixed(c, q, 4, "32-true") for c, q in zip(costs, layers, strict=True)]

    def profile(rows: list[LayerCost]) -> Profile:
        return Profile(num_ranks=2, layers={4: tuple(rows)}, partitions={1: (2, 2)})

    limit = min(c.peak for c in search(profile(sharded)))
    with pytest.raises(NoScheduleFits, match=f"memory_limit={limit:.0f} bytes"):
        choose(search(profile(costs)), limit)  # replicated: every replica holds its stages whole
    best = choose(search(profile(sharded)), limit).best
    assert best.peak <= limit


OPTIMIZERS = [
    (torch.optim.AdamW, {}, 2),
    (torch.optim.Adam, {"amsgrad": True}, 3),
    (torch.optim.SGD, {"momentum": 0.9}, 1),
    (torch.optim.SGD, {}, 0),
    (torch.optim.RMSprop, {"momentum": 0.9, "centered": True}, 3),
    (torch.optim.NAdam, {}, 2),
    (torch.optim.Adagrad, {}, 1),
]


@pytest.mark.parametrize("cls, kw, copies", OPTIMIZERS)
def test_optimizer_state_bytes_are_those_the_first_step_creates(cls, kw, copies):
    from lightning_twobp.lightning.autoschedule import optimizer_state_bytes

    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    opt = cls(model.parameters(), lr=0.1, **kw)
    predicted, notes = optimizer_state_bytes([opt])
    assert len(notes) == 1 and cls.__name__ in notes[0] and "not one this counts" not in notes[0]
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    for q in model.parameters():  # exact, per parameter, the 0-d step counters included
        state = [t for t in opt.state[q].values() if isinstance(t, torch.Tensor)]
        assert predicted[id(q)] == sum(t.untyped_storage().nbytes() for t in state)
        assert sum(t.numel() == q.numel() for t in state) == copies


def test_an_unknown_optimizer_is_counted_as_adam_and_says_so():
    from lightning_twobp.lightning.autoschedule import optimizer_state_bytes

    class Mine(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

    q = nn.Parameter(torch.zeros(10))
    predicted, notes = optimizer_state_bytes([Mine([q])])
    assert predicted[id(q)] == 2 * 40 + 4
    assert "Mine is not one this counts: taken as Adam's two copies" in notes[0]


@pytest.mark.parametrize(
    "value, expected",
    [(8e9, 8e9), (0.5, 50.0), ("1f1b", 30.0), ("0.5x1f1b", 15.0), ("2X1F1B", 60.0)],
)
def test_memory_limit_forms(value, expected):
    assert resolve_limit(value, device_bytes=100.0, fused_1f1b_peak=30.0) == expected


@pytest.mark.parametrize("value", [1.5, 2, 999])
def test_a_few_bytes_of_memory_limit_are_refused_as_meant_another_way(value):
    """memory_limit=1.5 was taken as 1.5 bytes, refused only after the layers were profiled, saying bytes."""
    from lightning_twobp import TwoBPStrategy

    wanted = rf"memory_limit={value} would be {value} bytes .* memory_limit='{value}x1f1b'"
    with pytest.raises(ValueError, match=wanted):
        TwoBPStrategy(schedule="auto", memory_limit=value)
    assert resolve_limit(1000, 100.0, 30.0) == 1000.0


@pytest.mark.parametrize("value", [0, -1, "big", "x1f1b", True, None])
def test_bad_memory_limits_say_what_works(value):
    with pytest.raises(ValueError, match="give bytes per device"):
        resolve_limit(value, 100.0, 30.0)


# ------------------------------------------------------------------ the strategy, 2 ranks


class Blocks(Regressor):
    """test_strategy's module (inputs doubled) with narrow Linear + Tanh blocks: every layer has weights,
    so any cut into 2 or 4 stages trains, and on batches of 128 the activations outweigh the weights, so
    memory_limit has something to trade."""

    def __init__(self, optimizer: type[torch.optim.Optimizer] = torch.optim.SGD) -> None:
        super().__init__(scale=2.0, optimizer=optimizer)
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(6 if i == 0 else 8, 8), nn.Tanh()) for i in range(LAYERS - 1)]
        self.layers = nn.Sequential(*blocks, nn.Linear(8, 2))


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    return DataLoader(TensorDataset(torch.randn(384, 6, generator=g), torch.randn(384, 2, generator=g)), batch_size=128)


class _Peak(pl.Callback):
    """The bytes the step holds above the weights, gradients and optimizer state, sampled after every F, B, W and
    BW by the meter of ``twobp-bench --memory-model`` (``footprint.StepMeter``): what autograd saved, what the
    stages keep for their micro-batches and for W, the receive buffers and the sends held (the step's signature
    among them), the parameters left out. The autograd side alone, as this meter was, missed the gradients B
    keeps for W under a split schedule."""

    def __init__(self) -> None:
        self.saved_peak = 0
        self._meter: StepMeter | None = None
        self._saved = None

    @property
    def peak(self) -> int:
        return 0 if self._meter is None else self._meter.peak

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from lightning_twobp.lightning.autoschedule import SavedBytes

        executor = trainer.strategy._pipeline.executor
        if self._meter is None or self._meter.executor is not executor:
            params = [q for s in executor.stages.values() for q in s.module.parameters()]
            self._meter = StepMeter(exclude={storage_key(q) for q in params})
            self._meter.executor = executor
            executor._around = self._meter.around  # what the bench's executor is built with
        self._saved = SavedBytes(exclude=list(pl_module.parameters())).__enter__()
        self._meter.saved = self._saved

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._saved.__exit__(None, None, None)
        self._meter.saved = None
        self.saved_peak = max(self.saved_peak, self._saved.peak)


def _trainer(strategy, devices: int, **kw) -> pl.Trainer:
    return quiet_trainer(strategy, devices, max_steps=3, **kw)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The optimizer's state as it stands: every tensor of it (AdamW's step counters too)."""
    tensors = [t for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return sum(t.untyped_storage().nbytes() for t in tensors)


class HFLlama(pl.LightningModule):
    """A Hugging Face LLaMa (the ModuleList contract: its blocks run through the model's own forward, with
    rotary embeddings and a causal mask made on every stage) trained on next tokens."""

    def __init__(self, optimizer: type[torch.optim.Optimizer] = torch.optim.SGD) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers", reason="the Hugging Face model needs transformers")
        torch.manual_seed(0)
        config = conftest.tiny_llama_config(hidden_size=32, intermediate_size=64, num_hidden_layers=4, use_cache=False)
        self.model = transformers.LlamaForCausalLM(config)
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        ids, targets = batch
        return nn.functional.cross_entropy(self.model(input_ids=ids).logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return self.optimizer(self.parameters(), lr=0.1)


def _tokens() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 32, (48, 16), generator=g)
    return DataLoader(TensorDataset(ids, (ids + 1) % 32), batch_size=16)


class HFT5(HFLlama):
    """A Hugging Face T5 whose decoder's blocks are pipelined (``layers=T5_BLOCKS``): the encoder runs on the
    first stage and its output travels beside the hidden state, with the first block's position biases."""

    def __init__(self, optimizer: type[torch.optim.Optimizer] = torch.optim.SGD) -> None:
        pl.LightningModule.__init__(self)
        transformers = pytest.importorskip("transformers", reason="the Hugging Face model needs transformers")
        torch.manual_seed(0)
        sizes = dict(d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=4, num_heads=2)
        config = transformers.T5Config(vocab_size=32, **sizes, dropout_rate=0.0, decoder_start_token_id=0)
        self.model = transformers.T5ForConditionalGeneration(config)
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        ids, targets = batch
        return self.model(input_ids=ids, labels=targets).loss


T5_BLOCKS = "model.decoder.block"


class HookClipped(Blocks):
    """Clipping by norm in a hook, which auto cannot see at setup (no gradient_clip_val, no override of
    configure_gradient_clipping): self.clip_gradients from on_before_optimizer_step, at a norm every step
    exceeds."""

    def on_before_optimizer_step(self, optimizer) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")


MODELS = {
    "blocks": (Blocks, _loader),
    "hf-llama": (HFLlama, _tokens),
    "hf-t5": (HFT5, _tokens),
    "hook-clipped": (HookClipped, _loader),
}


def _fit_auto(
    rank: int, world: int, memory_limit, optimizer=torch.optim.SGD, kind="blocks", precision="32-true", **options
) -> dict:
    from lightning_twobp import TwoBPStrategy

    lightning_env(rank, world)
    from lightning_twobp.lightning import pipeline
    from lightning_twobp.monitor import PipelineMonitor

    make, data = MODELS[kind]
    model, peak = make(optimizer), _Peak()
    monitor = PipelineMonitor(log_every_n_steps=1, measure_flops=False, log=False)
    strategy = TwoBPStrategy(schedule="auto", memory_limit=memory_limit, **options)
    trainer = _trainer(strategy, world, callbacks=[peak, monitor], precision=precision)
    said, announce = [], pipeline.rank_zero_info
    pipeline.rank_zero_info = lambda text, *a, **k: said.append(text) or announce(text, *a, **k)
    try:
        trainer.fit(model, data())
    finally:
        pipeline.rank_zero_info = announce
    choice = strategy.auto_choice
    logged = {k: v for k, v in monitor.last.items() if k.endswith("predicted_peak_mb")}
    assert sorted(logged.values()) == sorted(b / 1e6 for b in choice.best.peak_bytes), logged
    # what this rank holds whatever the schedule: its stages' weights and gradients and the optimizer's state
    fixed = sum(2 * q.numel() * q.element_size() for q in model.parameters() if not q.is_meta)
    state = _state_bytes(trainer.optimizers[0])
    return {
        "label": choice.best.label,
        "split": choice.best.split_backward,
        # a stage of this rank runs some backwards fused and others split
        "mixed": any(
            {a.kind for a in choice.best.schedule.actions[strategy.pp_rank] if a.stage == s} >= {"B", "BW"}
            for s in choice.best.schedule.stages_of(strategy.pp_rank)
        ),
        "limit": choice.limit,
        "predicted": choice.best.peak_bytes[strategy.pp_rank],
        "measured": fixed + state + peak.peak,
        "saved": peak.saved_peak,
        "optimizer_predicted": choice.best.optimizer_bytes[strategy.pp_rank],
        "optimizer_measured": state,
        "params": {n: q.detach().clone() for n, q in model.named_parameters() if not q.is_meta},
        "profile": strategy.auto_profile,
        "announced": [t for t in said if t.startswith("twobp: ")],  # the pipeline's line of what it runs
        "step_checks": strategy.step_checks,
    }


def _validate_then_fit(rank: int, world: int) -> dict:
    """schedule="auto" in a validate, then a fit, on one Trainer (one strategy): the choices each made."""
    from lightning_twobp import TwoBPStrategy

    lightning_env(rank, world)
    model = Blocks(torch.optim.AdamW)
    strategy = TwoBPStrategy(schedule="auto", memory_limit="1f1b", **FUSED_M4)
    trainer = _trainer(strategy, world)
    trainer.validate(model, _loader(), verbose=False)
    validated = (strategy.auto_choice, strategy.auto_profile)
    trainer.fit(model, _loader())
    return {
        "validated": validated,
        "fitted": (strategy.auto_choice, strategy.auto_profile),
        "state": _state_bytes(trainer.optimizers[0]),
        "rank": strategy.pp_rank,
        "params": {n: q.detach().clone() for n, q in model.named_parameters() if not q.is_meta},
    }


def _without_optimizer(profile: Profile) -> Profile:
    """The profile as auto saw it before it counted the optimizer's state."""
    layers = {m: tuple(dataclasses.replace(c, optimizer=0.0) for c in rows) for m, rows in profile.layers.items()}
    return dataclasses.replace(profile, layers=layers)


FUSED_M4 = {"split_backward": False, "num_microbatches": 4}  # fused orders do not depend on the timings


def _adamw_refused(rank: int, world: int) -> dict:
    """A limit that fits the smallest peak without AdamW's moments but not with them: refused."""
    from lightning_twobp import TwoBPStrategy

    profile = _fit_auto(rank, world, "2x1f1b", torch.optim.AdamW, **FUSED_M4)["profile"]
    without = min(c.peak for c in search(_without_optimizer(profile), split_backward=False))
    with_state = min(c.peak for c in search(profile, split_backward=False))
    try:
        strategy = TwoBPStrategy(schedule="auto", memory_limit=without, **FUSED_M4)
        _trainer(strategy, world).fit(Blocks(torch.optim.AdamW), _loader())
    except ValueError as e:
        return {"without": without, "with": with_state, "error": str(e)}
    return {"without": without, "with": with_state, "error": "no error"}


def _reference(optimizer=torch.optim.SGD, kind="blocks") -> dict:
    """One process on whole batches: every micro-batch count auto may pick splits them evenly, and the
    losses are means, so the pipeline's mean over micro-batches is this one's."""
    make, data = MODELS[kind]
    module = make(optimizer)
    _trainer("auto", 1).fit(module, data())
    return {n: q.detach() for n, q in module.named_parameters()}


def _fit_error(world: int, model: pl.LightningModule, exc: type[Exception], **options) -> str:
    """The message of the ``exc`` a fit with ``options`` raises ("no error" if none)."""
    from lightning_twobp import TwoBPStrategy

    try:
        _trainer(TwoBPStrategy(**options), world).fit(model, _loader())
    except exc as e:
        return str(e)
    return "no error"


def _after_a_call_without_gather(rank: int, world: int) -> str:
    """schedule="auto" in a second fit, after a first that left the other rank's layers on meta here."""
    lightning_env(rank, world)
    model = Blocks()
    _fit_error(world, model, ValueError, schedule="1f1b", num_microbatches=4)
    return _fit_error(world, model, ValueError, schedule="auto", memory_limit="1f1b")


class FailsValidationOnce(pl.Callback):
    """Raises at the end of the first validation (every rank)."""

    def __init__(self) -> None:
        self.failed = False

    def on_validation_end(self, trainer, pl_module) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("a callback failed at the end of validate")


def _failed_evaluation_then_fit(rank: int, world: int) -> list[str]:
    """schedule="auto": a validate that fails at its end (no gather: the other rank's layers stay on meta),
    then a fit on the same Trainer, which chooses again; then validate to its end and fit again."""
    from lightning_twobp import TwoBPStrategy

    lightning_env(rank, world)
    model, strategy = Blocks(), TwoBPStrategy(schedule="auto", memory_limit="1f1b", **FUSED_M4)
    trainer = _trainer(strategy, world, callbacks=[FailsValidationOnce()])
    said = []
    for call in (trainer.validate, trainer.fit, trainer.validate, trainer.fit):
        try:
            call(model, _loader())
            said.append("ok")
        except (RuntimeError, ValueError) as e:
            said.append(str(e))
    return said


def _time_then_validate(rank: int, world: int, **options) -> dict:
    """balance="time" times once, at the strategy's first call (and "auto" chooses once): validating after
    fit (the other rank's layers on meta here) cuts as fit did, with no second profile to fail on them."""
    from lightning_twobp import TwoBPStrategy

    lightning_env(rank, world)
    model, strategy = Blocks(), TwoBPStrategy(balance="time", **options)
    trainer = _trainer(strategy, world)
    trainer.fit(model, _loader())
    fitted, seconds, choice = list(strategy.stage_sizes), strategy.layer_seconds, strategy.auto_choice
    val = trainer.validate(model, _loader(), verbose=False)[0]["val_loss"]
    same = strategy.layer_seconds is seconds and strategy.auto_choice is choice
    return {"fit": fitted, "validate": strategy.stage_sizes, "same": same, "val": val}


def _profiled_as_it_runs(rank: int, world: int, model: str) -> dict:
    """A Sequential ``model`` of test_lightning_model.py under balance="time" and auto: every weight after 3 steps.
    InplaceFirst: a stage that starts with an in-place ReLU (torchvision's blocks): each layer is profiled as its
    stage runs it, the input cloned first (auto failed there with autograd's in-place error on a leaf).
    TupleBoundary: layers that pass (hidden, mask) on, and a step given the last one's tuple (auto failed on the
    tuple: AttributeError)."""
    import test_lightning_model

    from lightning_twobp import TwoBPStrategy

    lightning_env(rank, world)
    out = {}
    for name, options in {"time": {"balance": "time"}, "auto": {"schedule": "auto", "memory_limit": "1f1b"}}.items():
        module, strategy = getattr(test_lightning_model, model)(), TwoBPStrategy(gather_full_model=True, **options)
        _trainer(strategy, world).fit(module, conftest.regression_data(32, batch_size=8))
        out[name] = {n: q.detach().clone() for n, q in module.named_parameters()}
    return out


class _Unrunnable(nn.Linear):
    def forward(self, x):
        raise RuntimeError("this layer cannot run")


def _time_fails_on_rank_0(rank: int, world: int) -> str:
    """balance="time" times on rank 0 and sends the times on: a layer that fails there must not leave the
    other ranks waiting for them."""
    lightning_env(rank, world)
    model = Blocks()
    model.layers[3] = _Unrunnable(8, 8)
    return _fit_error(world, model, RuntimeError, schedule="1f1b", balance="time")


def _fit_checkpointed(rank: int, world: int) -> dict:
    """auto with and without activation_checkpointing="full": the bytes F saves per layer, as profiled,
    and whether rank 0 warned that B's recompute was not counted."""
    saved: dict = {}
    for ac in (None, "full"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            profile = _fit_auto(rank, world, "2x1f1b", activation_checkpointing=ac, **FUSED_M4)["profile"]
        saved[ac] = [c.activation for c in profile.layers[4]]
        saved[f"warned {ac}"] = any("without the transient of B's recompute" in str(w.message) for w in caught)
    return saved


def _split_pays(choose_profiles):
    """``autoschedule.choose_profiles`` on profiles whose fused backward costs twice B + W: the tiny layers'
    split costs about 3x their backward, so auto picks fused orders on them; priced so, it picks a split one
    (which one depends on the measured F, B and W, all split), and its measured peak is checked like the others'."""

    def dearer(profile: Profile | None) -> Profile | None:
        if profile is None:
            return None
        rows = {m: tuple(dataclasses.replace(c, bw=2 * (c.b + c.w)) for c in cs) for m, cs in profile.layers.items()}
        return dataclasses.replace(profile, layers=rows)

    def chosen(profile_of, *args, **kwargs):
        return choose_profiles(lambda mode: dearer(profile_of(mode)), *args, **kwargs)

    return chosen


def _fused_where_it_loses(choose_profiles):
    """``autoschedule.choose_profiles`` on profiles timed alike on every layer (F = B = W = 1 ms, BW 10% under
    B + W, the loss free): the fastest is then a split order with part of its backwards fused (schedules.fusion),
    whatever the machine measured."""

    def priced(profile: Profile | None) -> Profile | None:
        if profile is None:
            return None
        even = {"f": 1e-3, "b": 1e-3, "w": 1e-3, "bw": 2e-3 / 1.1}
        rows = {m: tuple(dataclasses.replace(c, **even) for c in cs) for m, cs in profile.layers.items()}
        loss = {m: dataclasses.replace(c, f=0.0, b=0.0, w=0.0, bw=None) for m, c in profile.loss.items()}
        return dataclasses.replace(profile, layers=rows, loss=loss, comm={m: 0.0 for m in profile.comm})

    def chosen(profile_of, *args, **kwargs):
        return choose_profiles(lambda mode: priced(profile_of(mode)), *args, **kwargs)

    return chosen


def _fit_repriced(reprice: Callable, rank: int, world: int) -> dict:
    """auto at 4x fused 1F1B's peak, m = 8, choosing on profiles ``reprice`` rewrites (the training is real)."""
    from lightning_twobp.lightning import autoschedule

    real = autoschedule.choose_profiles
    autoschedule.choose_profiles = reprice(real)
    try:
        return _fit_auto(rank, world, "4x1f1b", num_microbatches=8)
    finally:
        autoschedule.choose_profiles = real


def _fit_among(rank: int, world: int) -> dict:
    """auto among ZB-H1 only (``auto_schedules``), with what it said of its choice."""
    from lightning_twobp.lightning import autoschedule

    said, info = [], autoschedule.rank_zero_info
    autoschedule.rank_zero_info = lambda text, *a, **k: said.append(text) or info(text, *a, **k)
    try:
        out = _fit_auto(rank, world, "4x1f1b", num_microbatches=4, auto_schedules=["zb-h1"])
    finally:
        autoschedule.rank_zero_info = info
    return {**out, "name": out["label"].split(" ")[0], "said": said}


def _among_refused(rank: int, world: int) -> dict:
    """auto among ZB-V alone on a balance list of 2 stages: refused before any layer is profiled."""
    from lightning_twobp.lightning import autoschedule

    lightning_env(rank, world)
    profiled, real = [], autoschedule._Profiler.profile
    autoschedule._Profiler.profile = lambda self, mode: profiled.append(mode) or real(self, mode)
    try:
        said = _fit_error(
            world, Blocks(), ValueError, schedule="auto", memory_limit="4x1f1b", balance=[4, 4], auto_schedules=["zb-v"]
        )
    finally:
        autoschedule._Profiler.profile = real
    return {"said": said, "profiled": profiled}


CHECKPOINTED = "test_auto_profiles_the_layers_checkpointed"
AMONG_REFUSED = "test_auto_among_schedules_that_cannot_run_is_refused_before_profiling"
AMONG = "test_auto_among_the_schedules_given_trains_like_one_process"
LIMITS = ["1f1b", "0.8x1f1b"]
TRAINS = "test_auto_trains_like_one_process_within_its_limit"
SPLIT = "test_a_split_pick_trains_like_one_process_within_its_predicted_peak"
MIXED = "test_a_pick_fused_where_its_split_loses_trains_like_one_process_within_its_predicted_peak"
REFUSED = "test_a_limit_nothing_fits_is_refused_before_training_on_every_rank"
ADAMW = "test_auto_counts_adamw_state_and_stays_within_its_limit"
ADAMW_REFUSED = "test_a_limit_that_fits_only_without_adamw_state_is_refused_naming_it"
HF = "test_auto_on_a_hugging_face_model_trains_like_one_process_within_its_limit"
HF_V = "test_auto_counts_the_micro_batch_index_a_hugging_face_models_stages_send"
CHECKED = "test_auto_counts_what_a_check_after_the_step_holds"
HOOK_CLIPPED = "test_clipping_auto_could_not_see_is_checked_before_the_step_not_copied"
VALIDATE_THEN_FIT = "test_a_fit_after_an_evaluation_call_chooses_again_for_training"
FAILED_EVALUATION = "test_a_fit_after_a_failed_evaluation_call_is_refused_naming_the_fix"
T5 = "test_auto_plans_an_encoder_decoder_with_the_values_sent_beside_the_hidden_state"
HF_BF16 = "test_auto_profiles_the_layers_in_the_precisions_dtype"
BLOCKS_BF16 = "test_auto_profiles_a_sequential_on_the_batch_the_precision_converts"
LEFT = "test_auto_after_a_call_that_left_layers_elsewhere_is_refused_naming_the_fix"
TIME_FAILS = "test_a_layer_that_fails_to_time_on_rank_0_fails_every_rank"
INPLACE = "test_a_sequential_is_profiled_as_it_runs"
PROFILED = ["InplaceFirst", "TupleBoundary"]
TIME_ONCE = "test_balance_time_times_once_and_later_calls_cut_alike"
TIMED_ONCE = [{"schedule": "1f1b"}, {"schedule": "auto", "memory_limit": "1f1b"}]  # auto with balance="time"


@pytest.fixture(scope="module")
def two_ranks(request) -> conftest.Launch:
    """The limits, the refusals (raised on every rank before any step) in one launch of 2 ranks."""
    cases = {f"{TRAINS}[{limit}]": (_fit_auto, (limit,)) for limit in LIMITS}
    cases[REFUSED] = (_refused, ())
    cases[AMONG] = (_fit_among, ())
    cases[AMONG_REFUSED] = (_among_refused, ())
    cases[SPLIT] = (functools.partial(_fit_repriced, _split_pays), ())
    cases[MIXED] = (functools.partial(_fit_repriced, _fused_where_it_loses), ())
    cases[ADAMW] = (_fit_auto, ("1f1b", torch.optim.AdamW))
    cases[VALIDATE_THEN_FIT] = (_validate_then_fit, ())
    hook_clipped = functools.partial(_fit_auto, auto_schedules=["zb-v"])
    cases[HOOK_CLIPPED] = (hook_clipped, ("4x1f1b", torch.optim.SGD, "hook-clipped"))
    cases[ADAMW_REFUSED] = (_adamw_refused, ())
    cases[CHECKPOINTED] = (_fit_checkpointed, ())
    cases[HF] = (_fit_auto, ("1f1b", torch.optim.SGD, "hf-llama"))
    cases[CHECKED] = (_fit_checked, ())
    cases[HF_V] = (functools.partial(_fit_auto, auto_schedules=["zb-v"]), ("1f1b", torch.optim.SGD, "hf-llama"))
    cases[T5] = (functools.partial(_fit_auto, layers=T5_BLOCKS), ("1f1b", torch.optim.SGD, "hf-t5"))
    cases[HF_BF16] = (_fit_auto, ("1f1b", torch.optim.AdamW, "hf-llama", "bf16-true"))
    cases[BLOCKS_BF16] = (_fit_auto, ("1f1b", torch.optim.AdamW, "blocks", "bf16-true"))
    cases[LEFT] = (_after_a_call_without_gather, ())
    cases[FAILED_EVALUATION] = (_failed_evaluation_then_fit, ())
    cases[TIME_FAILS] = (_time_fails_on_rank_0, ())
    for model in PROFILED:
        cases[f"{INPLACE}[{model}]"] = (_profiled_as_it_runs, (model,))
    for options in TIMED_ONCE:
        cases[f"{TIME_ONCE}[{options['schedule']}]"] = (functools.partial(_time_then_validate, **options), ())
    return launch(request, 2, cases, timeout=600)


def _check_trained(results: list[dict], ref: dict, atol: float = 1e-6) -> None:
    assert len({r["label"] for r in results}) == 1, "every rank must choose the same schedule"
    merged = {n: v for r in results for n, v in r["params"].items()}
    assert set(merged) == set(ref)
    for name, value in merged.items():
        torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=atol, msg=name)
    for r in results:
        # seen on every step: the monitor records each (log_every_n_steps=1), and its hooks shadowed the meter's
        assert r["saved"] > 0, "no saved tensors measured"
        said = {k: v for k, v in r.items() if k not in ("params", "profile")}
        assert r["predicted"] <= r["limit"]
        # every rank's own prediction holds, not only the one that sets the limit (the other measured 252
        # bytes over its own on the tiny blocks: the loss's scalar held a 256-byte buffer, counted as 4)
        assert r["measured"] <= r["predicted"], said


@pytest.mark.dist
@pytest.mark.parametrize("memory_limit", LIMITS)
def test_auto_trains_like_one_process_within_its_limit(two_ranks, request, memory_limit):
    _check_trained(two_ranks[request.node.name], _reference())


@pytest.mark.dist
def test_auto_among_the_schedules_given_trains_like_one_process(two_ranks):
    results = two_ranks[AMONG]
    assert all(r["name"] == "zb-h1" for r in results), [r["label"] for r in results]
    assert any(t.startswith("twobp: schedule='auto' among zb-h1: zb-h1") for r in results for t in r["said"])
    _check_trained(results, _reference())


@pytest.mark.dist
def test_auto_among_schedules_that_cannot_run_is_refused_before_profiling(two_ranks):
    for r in two_ranks[AMONG_REFUSED]:
        assert "zb-v needs 4 stages on 2 ranks, and balance=[4, 4] cuts 2" in r["said"], r["said"]
        assert r["profiled"] == [], r


@pytest.mark.dist
def test_a_split_pick_trains_like_one_process_within_its_predicted_peak(two_ranks):
    results = two_ranks[SPLIT]
    assert all(r["split"] for r in results), [r["label"] for r in results]
    _check_trained(results, _reference())


@pytest.mark.dist
def test_a_pick_fused_where_its_split_loses_trains_like_one_process_within_its_predicted_peak(two_ranks):
    """Some micro-batches' backward fused (BW), the others split (B, then W), on one stage: exact, and every
    rank within its own predicted peak."""
    results = two_ranks[MIXED]
    assert all("backwards fused where the split loses" in r["label"] for r in results), [r["label"] for r in results]
    assert any(r["mixed"] for r in results), [r["label"] for r in results]
    for r in results:  # the pipeline says what it runs: the pick's family, fused in part, and how many
        fused = re.search(r"\d+ of \d+ backwards fused where the split loses", r["label"])
        assert fused is not None and len(r["announced"]) == 1, (r["label"], r["announced"])
        assert r["announced"][0].startswith(f"twobp: {r['label'].split(' (')[0]} ({fused.group(0)}), "), r["announced"]
    _check_trained(results, _reference())


@pytest.mark.dist
def test_auto_counts_adamw_state_and_stays_within_its_limit(two_ranks):
    results = two_ranks[ADAMW]
    # AdamW divides each gradient by its own root mean square: a gradient near zero, summed in another
    # order over micro-batches (fp32), moves its weight by up to 1e-4 of lr = 0.1 after 3 steps
    _check_trained(results, _reference(torch.optim.AdamW), atol=2e-5)
    for r in results:  # AdamW's two moments and step counter per parameter, counted before they exist
        assert r["optimizer_predicted"] == r["optimizer_measured"] > 0, r


@pytest.mark.dist
def test_a_limit_that_fits_only_without_adamw_state_is_refused_naming_it(two_ranks):
    out = two_ranks[ADAMW_REFUSED]
    assert out[0] == out[1], "both ranks refuse with the same numbers"
    r = out[0]
    assert r["without"] < r["with"], r
    assert f"memory_limit={r['without']:.0f} bytes" in r["error"], r["error"]
    assert f"the smallest predicted peak is {r['with']:.0f} bytes" in r["error"], r["error"]
    assert "optimizer state on rank" in r["error"], r["error"]
    # a given micro-batch count is the only one tried: a larger batch would make its micro-batches larger
    assert "num_microbatches=4 was given, so it is the only count tried" in r["error"], r["error"]


@pytest.mark.dist
def test_auto_on_a_hugging_face_model_trains_like_one_process_within_its_limit(two_ranks):
    """The ModuleList contract's layers are profiled through the model's own forward, one layer a stage
    (lightning/layer_runs.py): the embedding with the first block, the head and the loss with the last."""
    results = two_ranks[HF]
    _check_trained(results, _reference(kind="hf-llama"))
    for r in results:  # every layer timed and measured, the loss inside the last layer's run
        rows = r["profile"].layers[max(r["profile"].layers)]
        assert len(rows) == 4 and all(c.f > 0 and c.activation > 0 for c in rows), rows
        assert all(c.f == 0 and c.activation == 0 for c in r["profile"].loss.values()), r["profile"].loss


class DecaysEveryParameter(torch.optim.SGD):
    """A user's optimizer whose step may change a parameter without a gradient (not one of torch's own)."""


def _fit_checked(rank: int, world: int) -> dict:
    """schedule="auto" with clipping by norm, without, and with post_validation=False: the bytes each layer's
    check after the step holds, as the profile counted them, and the trained weights' bytes."""
    from lightning_twobp import TwoBPStrategy

    lightning_env(rank, world)
    out = {}
    runs = [("clipped", 0.5, None, torch.optim.SGD), ("unclipped", None, None, torch.optim.SGD)]
    runs += [("off", 0.5, False, torch.optim.SGD), ("frozen", 0.5, None, torch.optim.SGD)]
    runs += [("frozen-own", 0.5, None, DecaysEveryParameter)]
    for name, clip, post, optimizer in runs:
        model = Blocks(optimizer)  # SGD without momentum: no optimizer state
        if name.startswith("frozen"):  # the first layer frozen, in the optimizer (as a LoRA's base)
            model.layers[0].requires_grad_(False)
        strategy = TwoBPStrategy(schedule="auto", memory_limit="2x1f1b", post_validation=post, **FUSED_M4)
        quiet_trainer(strategy, world, max_steps=1, gradient_clip_val=clip).fit(model, _loader())
        out[name] = {
            "checked": [c.checked for c in strategy.auto_profile.layers[4]],
            "after": strategy.auto_profile.checked_after,
        }
    out["weights"] = [sum(4 * q.numel() for q in layer.parameters()) for layer in Blocks().layers]
    return out


@pytest.mark.dist
def test_auto_counts_what_a_check_after_the_step_holds(two_ranks):
    """Post-validation (on by default for zb-h2 and zb-v) with clipping by norm keeps the step's gradients until
    the next step has run and a copy of the weights and optimizer state to put back: counted per layer (before
    stop 57 the search left both out, so a pick that checks after its step could exceed the limit by up to
    twice the weights with SGD, four times with AdamW); without clipping it keeps nothing (since stop 58), and
    nothing is counted where the user turns the check off."""
    for r in two_ranks[CHECKED]:
        assert r["clipped"]["checked"] == [2 * b for b in r["weights"]], r
        assert r["unclipped"]["checked"] == [0] * len(r["weights"]), r  # nothing to put back: nothing kept
        assert r["clipped"]["after"] is None and r["off"]["after"] is False, r
        # a frozen layer: no gradient; its weights copied only where the optimizer's step may change them
        assert r["frozen"]["checked"] == [0, *r["clipped"]["checked"][1:]], r
        assert r["frozen-own"]["checked"] == [r["weights"][0], *r["clipped"]["checked"][1:]], r


@pytest.mark.dist
def test_clipping_auto_could_not_see_is_checked_before_the_step_not_copied(two_ranks):
    """ZB-V checks its optimizer steps after taking them, and a clipped step is put back from a copy of the
    weights and optimizer state; auto counts that copy where it can see the clipping. Begun in a hook, it
    could not: the copy was kept anyway, beyond what the choice was made within (every clipped step redone
    from it). Now those steps are checked before they are taken (none redone), clipped as in one process."""
    results = two_ranks[HOOK_CLIPPED]
    _check_trained(results, _reference(kind="hook-clipped"))
    for r in results:
        assert r["label"].startswith("zb-v"), r["label"]
        assert r["step_checks"]["clipped"] == 3 and r["step_checks"]["redone"] == 0, r["step_checks"]


@pytest.mark.dist
def test_a_fit_after_an_evaluation_call_chooses_again_for_training(two_ranks):
    """A choice made in validate counts no backward, gradients or optimizer state; kept by the fit after it
    (before stop 58), the fit ran a choice whose predicted peak left those out and whose "1f1b" limit was
    fused 1F1B's peak in evaluation. The fit chooses again, counting AdamW's state, from the whole model
    (the validate call kept every layer on every rank for it), and trains like one process."""
    results = two_ranks[VALIDATE_THEN_FIT]
    for r in results:
        (choice, profile), (again, trained) = r["validated"], r["fitted"]
        assert again is not choice and again.limit > choice.limit, (choice.limit, again.limit)
        assert not any(c.optimizer for c in profile.layers[4]) and all(c.optimizer for c in trained.layers[4])
        assert r["state"] == again.best.optimizer_bytes[r["rank"]] > 0, r
    ref = _reference(optimizer=torch.optim.AdamW)
    merged = {n: v for r in results for n, v in r["params"].items()}
    assert set(merged) == set(ref)
    for name, value in merged.items():  # atol as test_auto_counts_adamw_state_and_stays_within_its_limit's
        torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=2e-5, msg=name)


@pytest.mark.dist
def test_auto_counts_the_micro_batch_index_a_hugging_face_models_stages_send(two_ranks):
    """The ModuleList contract sends a 0-d int64 micro-batch index beside the hidden state and the first stage
    keeps one with its inputs: 8 bytes a micro-batch in flight, which the profile left out, so under the V (rank
    1 holds the turn, up to 5 micro-batches in flight) the measured peak was 8-40 bytes above the predicted."""
    _check_trained(two_ranks[HF_V], _reference(kind="hf-llama"))


@pytest.mark.dist
def test_auto_plans_an_encoder_decoder_with_the_values_sent_beside_the_hidden_state(two_ranks):
    """T5's decoder blocks take the encoder's output and the first block's position biases beside the hidden
    state (docs/strategy.md, "Values passed between stages"): each layer is profiled on all of them, and a
    stage's message counts them (auto refused such models before)."""
    results = two_ranks[T5]
    _check_trained(results, _reference(kind="hf-t5"))
    for r in results:
        m = max(r["profile"].layers)
        rows, hidden = r["profile"].layers[m], (16 // m) * 16 * 16 * 4  # a micro-batch's hidden state, fp32
        # the encoder's output (as large as the hidden state here), the biases and their positions go on too
        assert all(c.output > 2 * hidden for c in rows[:-1]), (hidden, rows)
        assert all(c.f > 0 and c.activation > 0 for c in rows), rows


@pytest.mark.dist
def test_auto_profiles_the_layers_in_the_precisions_dtype(two_ranks):
    """Under "bf16-true" the model is cast after the cut: auto profiles copies cast as it will be (weights,
    gradients, AdamW's state and activations in bf16). Profiled as built (fp32), it predicted about twice
    the measured peak, and the fp32 block shapes it learned made a V's rotary embeddings fp32 in training
    ("Expected query, key, and value to have the same dtype")."""
    params = sum(q.numel() for q in HFLlama().parameters())
    for r in two_ranks[HF_BF16]:
        assert r["optimizer_predicted"] == r["optimizer_measured"] > 0, r["label"]  # AdamW's bf16 moments
        rows = r["profile"].layers[max(r["profile"].layers)]
        assert sum(c.fixed for c in rows) == 2 * 2 * params  # bf16 weights and gradients
        assert r["measured"] <= r["limit"], {k: v for k, v in r.items() if k not in ("params", "profile")}
        assert all(v.dtype == torch.bfloat16 and torch.isfinite(v).all() for v in r["params"].values())


@pytest.mark.dist
def test_auto_profiles_a_sequential_on_the_batch_the_precision_converts(two_ranks):
    """The Sequential's float inputs, converted to bf16 as the loop converts them for bf16 weights (fp32,
    they met the cast copies in a dtype error)."""
    params = sum(q.numel() for q in Blocks().parameters())
    for r in two_ranks[BLOCKS_BF16]:
        assert sum(c.fixed for c in r["profile"].layers[max(r["profile"].layers)]) == 2 * 2 * params
        assert r["optimizer_predicted"] == r["optimizer_measured"] > 0 and r["measured"] <= r["limit"], r["label"]


@pytest.mark.dist
def test_auto_after_a_call_that_left_layers_elsewhere_is_refused_naming_the_fix(two_ranks):
    for message in two_ranks[LEFT]:
        assert "an earlier Trainer call left 4 of the 8 layers" in message, message
        assert "pass gather_full_model=True to the earlier call" in message, message


@pytest.mark.dist
def test_a_fit_after_a_failed_evaluation_call_is_refused_naming_the_fix(two_ranks):
    """The fit chooses again (a first choice made in validate counted no backward) and times every layer, but the
    failed validate left the other rank's layers on meta; its advice works: validate to the end, then fit."""
    for said in two_ranks[FAILED_EVALUATION]:
        assert said[0] == "a callback failed at the end of validate", said
        assert "schedule='auto' chooses again at this fit" in said[1], said
        assert "that call failed before giving every rank the whole model: 4 of the 8 layers" in said[1], said
        assert "run the evaluation call to its end first" in said[1], said
        assert said[2:] == ["ok", "ok"], said


@pytest.mark.dist
@pytest.mark.parametrize("model", PROFILED)
def test_a_sequential_is_profiled_as_it_runs(two_ranks, request, model):
    import test_lightning_model

    torch.manual_seed(0)
    reference = getattr(test_lightning_model, model)()
    _trainer("auto", 1).fit(reference, conftest.regression_data(32, batch_size=8))
    for out in two_ranks[request.node.name]:
        for name in ("time", "auto"):
            for n, q in reference.named_parameters():
                torch.testing.assert_close(out[name][n], q.detach(), rtol=1e-5, atol=1e-6, msg=f"{name} {n}")


@pytest.mark.dist
def test_a_layer_that_fails_to_time_on_rank_0_fails_every_rank(two_ranks):
    first, second = two_ranks[TIME_FAILS]
    assert "this layer cannot run" in first, first
    assert 'balance="time": rank 0 could not time the layers: RuntimeError: this layer cannot run' in second, second


@pytest.mark.dist
@pytest.mark.parametrize("options", TIMED_ONCE, ids=lambda o: o["schedule"])
def test_balance_time_times_once_and_later_calls_cut_alike(two_ranks, request, options):
    first, second = two_ranks[request.node.name]
    assert first["fit"] == first["validate"] == second["fit"] == second["validate"], (first, second)
    assert first["same"] and second["same"]
    assert first["val"] == second["val"]


def _refused(rank: int, world: int) -> str:
    lightning_env(rank, world)
    return _fit_error(world, Blocks(), ValueError, schedule="auto", memory_limit=1000)


@pytest.mark.dist
def test_a_limit_nothing_fits_is_refused_before_training_on_every_rank(two_ranks):
    out = two_ranks[REFUSED]
    assert out[0] == out[1], "both ranks refuse with the same numbers"
    assert "memory_limit=1000 bytes" in out[0] and "the smallest predicted peak is" in out[0], out[0]
    # activation_checkpointing=None: one checkpointed profile more says what "full" would hold
    assert "Checkpointed blocks would not fit either: the smallest predicted peak is then" in out[0], out[0]
    assert "num_microbatches" not in out[0], out[0]  # no count given: auto tried every divisor


def test_the_layers_are_profiled_cast_as_the_precision_casts_them_and_put_back_bitwise():
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

    from lightning_twobp.lightning.layer_runs import placed, trained_dtype

    assert trained_dtype(HalfPrecision("bf16-true")) == torch.bfloat16
    assert trained_dtype(HalfPrecision("16-true")) == torch.float16
    assert trained_dtype(Precision()) is None and trained_dtype(MixedPrecision("bf16-mixed", "cpu")) is None
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    weight, before = layer.weight, layer.weight.detach().clone()
    with placed(layer, layer, torch.device("cpu"), torch.bfloat16):
        assert layer.weight is weight and layer.weight.dtype == torch.bfloat16
    assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight, before)  # no round trip through bf16


def test_gradients_are_set_aside_while_a_layer_runs_cast_and_put_back():
    from lightning_twobp.lightning.layer_runs import placed

    layer = nn.Linear(4, 4)
    layer.weight.grad = torch.ones(4, 4)
    with placed(layer, layer, torch.device("cpu"), torch.bfloat16):
        assert layer.weight.grad is None
        layer(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()  # the run's gradient, in bf16
        assert layer.weight.grad.dtype == torch.bfloat16
    assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight.grad, torch.ones(4, 4))
    assert layer.bias.grad is None


def test_a_frozen_weight_counts_once_in_a_layers_fixed_bytes():
    """A LoRA's base weights: held, with no gradient (they counted nothing)."""
    from lightning.pytorch.plugins.precision import Precision

    from lightning_twobp.lightning.autoschedule import _profile_layers
    from lightning_twobp.lightning.layer_runs import LayerRun, LayerRuns

    frozen, trained = nn.Linear(8, 8), nn.Linear(8, 8)
    frozen.requires_grad_(False)
    cpu = torch.device("cpu")
    runs = LayerRuns(
        [LayerRun(layer, layer) for layer in (frozen, trained)],
        (torch.randn(4, 8),),
        False,
        frozen,
        cpu,
        None,
        Precision(),
    )
    rows, _, _ = _profile_layers(runs, cpu, 1)
    assert [c.fixed for c in rows] == [72 * 4, 2 * 72 * 4]


def test_auto_options_are_checked_at_construction():
    from lightning_twobp import TwoBPStrategy

    with pytest.raises(ValueError, match="schedule='auto' picks the fastest schedule within memory_limit"):
        TwoBPStrategy(schedule="auto")
    with pytest.raises(ValueError, match="schedule='auto' chooses max_pending_w itself"):
        TwoBPStrategy(schedule="auto", memory_limit="1f1b", max_pending_w=1)
    with pytest.raises(ValueError, match="with schedule='1f1b' drop it, or use schedule='auto'"):
        TwoBPStrategy(schedule="1f1b", memory_limit=0.5)
    with pytest.raises(ValueError, match="give bytes per device"):
        TwoBPStrategy(schedule="auto", memory_limit="lots")
    auto = dict(schedule="auto", memory_limit="1f1b")
    assert TwoBPStrategy(**auto, auto_schedules=["zb-v", "1f1b"]).requested.auto_schedules == ("zb-v", "1f1b")
    with pytest.raises(ValueError, match="auto_schedules=.* is the list schedule='auto' chooses among; with "):
        TwoBPStrategy(schedule="zb-v", auto_schedules=["zb-v"])
    with pytest.raises(ValueError, match="leaves schedule='auto' nothing to choose"):
        TwoBPStrategy(**auto, auto_schedules=[])
    with pytest.raises(ValueError, match="unknown schedule 'zb-x'; choose among"):
        TwoBPStrategy(**auto, auto_schedules=["zb-x"])
    with pytest.raises(ValueError, match="names a schedule twice"):
        TwoBPStrategy(**auto, auto_schedules=["1f1b", "1f1b"])
    with pytest.raises(ValueError, match="zb-h1 is split by definition.*or leave 'zb-h1' out"):
        TwoBPStrategy(**auto, auto_schedules=["1f1b", "zb-h1"], split_backward=False)


# ------------------------------------------------------------------ the strategy sharded, pp 2 x dp 2


def _fit_sharded(rank: int, world: int) -> dict:
    """schedule="auto" under data_parallel="shard" on pp 2 x dp 2: the fixed bytes auto counted per layer,
    against each layer's as the planner counts one replica's (sharded_static_bytes); then replicated, the
    reduce's buffer it counts per layer (its gradients' bytes)."""
    from lightning_twobp import TwoBPStrategy
    from lightning_twobp.lightning.sharding import sharded_static_bytes

    lightning_env(rank, world)
    model = Blocks()  # SGD without momentum: no optimizer state
    expected = []
    for layer in model.layers:
        trained = [q for q in layer.parameters() if q.requires_grad]
        weight = sum(q.numel() * q.element_size() for q in trained)
        expected.append(sharded_static_bytes(sum(q.numel() for q in trained), weight, weight, 0, 2, "32-true"))
    strategy = TwoBPStrategy(schedule="auto", memory_limit="1f1b", pipeline_degree=2, data_parallel="shard", **FUSED_M4)
    quiet_trainer(strategy, world, max_steps=1).fit(model, _loader())
    counted = [c.fixed + c.optimizer for c in strategy.auto_profile.layers[4]]
    out = {"expected": expected, "counted": counted, "label": strategy.auto_choice.best.label}
    # replicated: each layer's gradients counted once more, the reduce's buffer (0 when sharded)
    out["sharded_reduced"] = [c.reduced for c in strategy.auto_profile.layers[4]]
    model = Blocks()
    out["grads"] = [sum(4 * q.numel() for q in layer.parameters() if q.requires_grad) for layer in model.layers]
    strategy = TwoBPStrategy(schedule="auto", memory_limit="2x1f1b", pipeline_degree=2, **FUSED_M4)
    quiet_trainer(strategy, world, max_steps=1).fit(model, _loader())
    out["reduced"] = [c.reduced for c in strategy.auto_profile.layers[4]]
    return out


@pytest.mark.dist
def test_auto_counts_a_sharded_stage_as_one_replica_holds_it_and_a_replicated_ones_reduce(request):
    results = launch(request, 4, {request.node.name: (_fit_sharded, ())}, timeout=600)[request.node.name]
    assert len({r["label"] for r in results}) == 1, "every rank must choose the same schedule"
    for r in results:
        # fp32 weights: 1/2 of weights and gradients plus a step's gathered weights and gradients, 3x the
        # weights where a replicated stage holds 2x
        assert r["counted"] == r["expected"], r
        assert r["reduced"] == r["grads"] and not any(r["sharded_reduced"]), r


@pytest.mark.dist
def test_auto_profiles_the_layers_checkpointed(two_ranks):
    """The search reads what F saves as the layers will run: checkpointed, each layer's input only
    (was profiled on the bare layers: activation_checkpointing ignored)."""
    for r in two_ranks[CHECKPOINTED]:
        assert all(c < p for c, p in zip(r["full"], r[None][:-1], strict=False)), r
    # named by the user, checkpointing is searched without B's recompute bytes (only "auto" measures
    # them, test_auto_checkpointing.py): rank 0 says so
    first = two_ranks[CHECKPOINTED][0]
    assert first["warned full"] and not first["warned None"], first


@pytest.mark.dist
def test_the_agreed_table_carries_each_layers_fused_backward(two_ranks):
    """Every layer's and the loss's measured BW crosses the all-reduce: both ranks read the same positive
    seconds, which price the fused schedules (tests/test_auto_split_price.py)."""
    results = two_ranks[f"{TRAINS}[1f1b]"]
    seen = [
        [c.bw for m in sorted(r["profile"].layers) for c in (*r["profile"].layers[m], r["profile"].loss[m])]
        for r in results
    ]
    assert seen[0] == seen[1] and all(bw is not None and bw > 0 for bw in seen[0]), seen


def test_auto_says_when_its_choice_drops_batch_w():
    from lightning_twobp.lightning.pipeline import _say_dropped
    from lightning_twobp.options import PipelineOptions

    req = PipelineOptions(schedule="auto", memory_limit="1f1b", batch_w=True)
    with pytest.warns(UserWarning, match="batch_w is not applied: schedule='auto' chose ZB-H1"):
        _say_dropped(req, dataclasses.replace(req, schedule="zb-h1", memory_limit=None, batch_w=False), "ZB-H1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _say_dropped(req, dataclasses.replace(req, schedule="1f1b", memory_limit=None), "1F1B")


def test_a_model_normalised_by_batch_statistics_keeps_one_micro_batch_count():
    """A training BatchNorm normalises each micro-batch by its own statistics, so the count changes what is
    trained: auto weighs the default 2p alone (or the largest divisor of the batch below it), not whichever
    count the run's timings favour (a trial's two launches of one configuration trained two models)."""
    from lightning_twobp.lightning.autoschedule import _counts

    plain = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)]
    normed = [nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)), nn.ReLU()]
    assert _counts(plain, 16, 2) == [1, 2, 4, 8]
    assert _counts(normed, 16, 2) == [4]
    assert _counts(normed, 6, 2) == [2]  # 4 does not divide 6: the largest multiple of p below it
    assert _counts(normed, 9, 4) == [3]  # no multiple of p divides 9: the largest divisor below 2p
    normed[0].eval()  # running statistics: the count changes nothing
    assert _counts(normed, 16, 2) == [1, 2, 4, 8]
    # without running statistics a batch norm uses the batch's in eval too; the lazy ones count alike
    assert _counts([nn.BatchNorm1d(4, track_running_stats=False).eval()], 16, 2) == [4]
    assert _counts([nn.Sequential(nn.LazyBatchNorm1d())], 16, 2) == [4]
    assert _counts([nn.SyncBatchNorm(4)], 16, 2) == [4]
