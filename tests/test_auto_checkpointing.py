"""schedule="auto" with activation_checkpointing="auto" (issue 20): memory is one knob. The search weighs
the layers plain and checkpointed; checkpointing is chosen where only it fits. The search as data, the
option's checks, then the strategy on 2 ranks against one process."""

from __future__ import annotations

import dataclasses
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_twobp.options import PipelineOptions, check_activation_checkpointing
from lightning_twobp.schedules.auto import (
    LayerCost,
    NoScheduleFits,
    Profile,
    choose,
    format_choice,
    search,
    search_profiles,
    with_recompute,
)

from conftest import Regressor, launch, lightning_env, quiet_trainer

# ------------------------------------------------------------------ the search, as data

LAYERS = 8
COUNTS = (2, 4, 8)


def _profiles(p: int = 2) -> tuple[Profile, Profile]:
    """Equal layers, run plain and checkpointed "full": checkpointed, F saves a tenth of the bytes (the
    layer's input) and B recomputes F, so it is smaller and slower; its recompute holds the rest."""

    def at(m: int, full: bool) -> tuple[LayerCost, ...]:
        s = 8 / m  # batch 8 in m micro-batches
        b = 2 * s + 1 if full else s + 0.5
        layer = LayerCost(f=s + 0.5, b=b, w=s + 0.5, activation=(10 if full else 100) * s, held=40 * s, fixed=1000)
        return (layer,) * LAYERS

    partitions = {1: (LAYERS // p,) * p, 2: (LAYERS // (2 * p),) * (2 * p)}
    plain = Profile(p, {m: at(m, False) for m in COUNTS}, partitions)
    full = Profile(p, {m: at(m, True) for m in COUNTS}, partitions, checkpointing="full")
    return plain, with_recompute(full, plain)


def test_checkpointing_is_chosen_only_where_nothing_plain_fits():
    plain, full = _profiles()
    candidates = search_profiles([plain, full])
    assert {c.checkpointing for c in candidates} == {None, "full"}
    plain_min = min(c.peak for c in candidates if c.checkpointing is None)
    full_min = min(c.peak for c in candidates if c.checkpointing == "full")
    assert full_min < plain_min
    loose = choose(candidates, float("inf")).best
    assert loose.checkpointing is None and "activation_checkpointing" not in loose.label
    tight = choose(candidates, plain_min - 1).best
    assert tight.checkpointing == "full" and tight.peak <= plain_min - 1
    assert "activation_checkpointing='full'" in tight.label
    assert "activation_checkpointing='full'" in format_choice(choose(candidates, plain_min - 1))
    # the options the choice runs with: checkpointing as chosen, only where the user let auto choose
    opts = PipelineOptions(schedule="auto", memory_limit="1f1b", activation_checkpointing="auto")
    assert opts.chosen(tight).activation_checkpointing == "full"
    assert opts.chosen(loose).activation_checkpointing is None
    assert dataclasses.replace(opts, activation_checkpointing=2).chosen(loose).activation_checkpointing == 2


def test_a_limit_nothing_fits_names_the_smallest_over_both():
    candidates = search_profiles(_profiles())
    smallest = min(candidates, key=lambda c: c.peak)
    assert smallest.checkpointing == "full"
    with pytest.raises(NoScheduleFits, match=rf"smallest predicted peak is {smallest.peak:.0f} bytes") as info:
        choose(candidates, smallest.peak - 1)
    assert info.value.smallest.checkpointing == "full"
    assert "activation_checkpointing='full'" in str(info.value)
    assert "activation_checkpointing='auto'" not in str(info.value)  # it was searched: nothing to suggest


def test_without_checkpointing_a_refusal_says_what_it_would_hold():
    plain, full = _profiles()
    candidates, checkpointed = search(plain), search(full)
    plain_min = min(c.peak for c in candidates)
    full_min = min(c.peak for c in checkpointed)
    with pytest.raises(NoScheduleFits, match="activation_checkpointing='auto'") as info:
        choose(candidates, plain_min - 1)  # not measured: the option is named
    assert "would" not in str(info.value)
    with pytest.raises(NoScheduleFits, match=rf"would fit: the smallest predicted peak is then {full_min:.0f}"):
        choose(candidates, plain_min - 1, checkpointed)
    with pytest.raises(NoScheduleFits, match=rf"would not fit either: .* is then {full_min:.0f} bytes") as info:
        choose(candidates, full_min - 1, checkpointed)
    assert info.value.smallest.checkpointing is None  # never chosen, only named


def test_a_checkpointed_peak_holds_bs_recompute_of_one_layer():
    plain, full = _profiles()
    bare = dataclasses.replace(full, recompute={})
    assert full.recompute[8] == (90.0,) * LAYERS  # plain's 100 less the 10 F saved, per micro-batch of 1
    for split in (False, True):
        counted = search(full, families=["1f1b"], microbatches=[8], split_backward=split)
        uncounted = search(bare, families=["1f1b"], microbatches=[8], split_backward=split)
        for a, b in zip(uncounted, counted, strict=True):
            extra = [y - x for x, y in zip(a.peak_bytes, b.peak_bytes, strict=True)]
            # rank 0 (the first stage, a plain backward): one layer's 90 at a time; rank 1 under the split:
            # its first layer's 90 on top of the 40 held for W by each of the 3 layers B went through
            assert extra == ([90.0, 90.0 + 3 * 40.0] if split else [90.0, 90.0]), (split, b.label)
    assert not any(c.checkpointing for c in search(plain))


def test_selective_is_the_pick_where_it_fits_and_full_below_it():
    """A third profile, selective: B recomputes only the cheap ops (a little slower than plain), F saves
    half what plain does. Between its smallest peak and plain's it is the pick; below it, "full"."""
    from lightning_twobp.lightning.checkpointing import AUTO_MODES

    assert AUTO_MODES == (None, "selective", "full")
    plain, full = _profiles()
    sel_rows = {
        m: tuple(dataclasses.replace(c, b=c.b + 0.1, activation=c.activation / 2) for c in rows)
        for m, rows in plain.layers.items()
    }
    selective = with_recompute(dataclasses.replace(plain, layers=sel_rows, checkpointing="selective"), plain)
    candidates = search_profiles([plain, selective, full])
    mins = {mode: min(c.peak for c in candidates if c.checkpointing == mode) for mode in AUTO_MODES}
    assert mins["full"] < mins["selective"] < mins[None], mins
    between = choose(candidates, (mins["selective"] + mins[None]) / 2).best
    assert between.checkpointing == "selective" and "activation_checkpointing='selective'" in between.label
    below = choose(candidates, (mins["full"] + mins["selective"]) / 2).best
    assert below.checkpointing == "full"
    assert choose(candidates, float("inf")).best.checkpointing is None  # plain is the fastest


def test_the_option_is_checked_before_any_compute():
    from lightning_twobp import TwoBPStrategy

    TwoBPStrategy(schedule="auto", memory_limit="1f1b", activation_checkpointing="auto")
    with pytest.raises(ValueError, match=r"schedule='1f1b', activation_checkpointing='auto'\): .* use schedule='auto'"):
        TwoBPStrategy(schedule="1f1b", activation_checkpointing="auto")
    with pytest.raises(ValueError, match="use schedule='auto' with a memory_limit"):
        check_activation_checkpointing("auto")
    assert check_activation_checkpointing("auto", "auto") == "auto"
    with pytest.raises(ValueError, match=r"with schedule='auto', 'auto'"):
        check_activation_checkpointing("AUTO", "auto")


def test_the_plan_weighs_checkpointing_too():
    """twobp-plan schedule=auto strategy.activation_checkpointing=auto, on meta: the same search."""
    from lightning_twobp.plan import plan_recipe

    base = ["trainer.devices=2", "schedule=auto"]
    with pytest.raises(NoScheduleFits, match="Checkpointed blocks would not fit either") as plain:
        plan_recipe([*base, "strategy.memory_limit=1000"])
    with pytest.raises(NoScheduleFits) as both:
        plan_recipe([*base, "strategy.memory_limit=1000", "strategy.activation_checkpointing=auto"])
    plain_min, full_min = plain.value.smallest.peak, both.value.smallest.peak
    assert both.value.smallest.checkpointing == "full" and full_min < plain_min
    limit = f"strategy.memory_limit={(plain_min + full_min) / 2:.0f}"
    chosen = plan_recipe([*base, limit, "strategy.activation_checkpointing=auto"])
    assert chosen.activation_checkpointing == "full", chosen.notes
    assert any("activation_checkpointing='full'" in n for n in chosen.notes), chosen.notes
    with pytest.raises(NoScheduleFits, match="With checkpointed blocks it would fit"):
        plan_recipe([*base, limit])  # activation_checkpointing=None: refused, naming what "full" would hold


# ------------------------------------------------------------------ the strategy, 2 ranks


class _Tanh(nn.Tanh):
    """A Tanh counting its forwards: under checkpointing B's recompute runs it again."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


class Wide(Regressor):
    """Blocks that widen to 128 and back to 8: plain, a block saves 17 times what it saves checkpointed
    (its input), so on batches of 128 checkpointing buys memory the weights do not take back."""

    def __init__(self) -> None:
        super().__init__(scale=2.0)
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(6 if i == 0 else 8, 128), _Tanh(), nn.Linear(128, 8)) for i in range(4)]
        self.layers = nn.Sequential(*blocks, nn.Linear(8, 2))


class _TanhInPlace(_Tanh):
    """Shifts its input in place first: the product before it, written after F made it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.add_(0.5))


class WideInPlace(Regressor):
    """``Wide`` with each block's first product written in place (as Hugging Face ConvBERT's ``x += bias``):
    selective checkpointing keeps that product from F to B, and torch refuses the written copy in B."""

    def __init__(self) -> None:
        super().__init__(scale=2.0)
        torch.manual_seed(0)
        blocks = [
            nn.Sequential(nn.Linear(6 if i == 0 else 8, 128), _TanhInPlace(), nn.Linear(128, 8)) for i in range(4)
        ]
        self.layers = nn.Sequential(*blocks, nn.Linear(8, 2))


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    return DataLoader(TensorDataset(torch.randn(256, 6, generator=g), torch.randn(256, 2, generator=g)), batch_size=128)


class _Forwards(pl.Callback):
    """Each of this rank's blocks: its forwards in the last training step, and whether it runs wrapped.
    (The first step also runs each stage but the last once more, for its output's shape: the executor's
    probe before the first send.)"""

    def __init__(self) -> None:
        self.forwards: dict[int, int] = {}
        self.wrapped: dict[int, bool] = {}

    def _mine(self, pl_module):
        """The blocks this rank holds (the others are set aside for the call: no parameters, or meta)."""
        held = [(i, b, next(iter(b.parameters()), None)) for i, b in enumerate(pl_module.layers[:-1])]
        return [(i, b) for i, b, q in held if q is not None and not q.is_meta]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        for _, block in self._mine(pl_module):
            block[1].calls = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for i, block in self._mine(pl_module):
            self.forwards[i] = block[1].calls
            self.wrapped[i] = "forward" in vars(block)  # the checkpointing wrapper: an instance attribute


def _fit(rank: int, world: int, memory_limit: float, make: type = Wide) -> dict:
    from lightning_twobp import TwoBPStrategy

    lightning_env(rank, world)
    model, seen = make(), _Forwards()
    strategy = TwoBPStrategy(schedule="auto", memory_limit=memory_limit, activation_checkpointing="auto")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        quiet_trainer(strategy, world, max_steps=2, callbacks=[seen]).fit(model, _loader())
    choice = strategy.auto_choice
    return {
        "label": choice.best.label,
        "checkpointing": choice.best.checkpointing,
        "m": choice.best.num_microbatches,
        "limit": choice.limit,
        "peak": choice.best.peak,
        "plain": min(c.peak for c in choice.considered if c.checkpointing is None),
        "full": min(c.peak for c in choice.considered if c.checkpointing == "full"),
        "forwards": seen.forwards,
        "wrapped": seen.wrapped,
        "left_wrapped": any("forward" in vars(b) for b in model.layers),
        "params": {n: q.detach().clone() for n, q in model.named_parameters() if not q.is_meta},
        "modes": sorted({str(c.checkpointing) for c in choice.considered}),
        "said": [str(w.message) for w in said],
    }


def _loose_then_tight(rank: int, world: int) -> dict:
    """A limit every candidate fits, then one between the smallest checkpointed and plain peaks; and the
    blocks selective checkpointing cannot run, at that limit."""
    loose = _fit(rank, world, 1e12)
    tight = _fit(rank, world, (loose["plain"] + loose["full"]) / 2)
    return {"loose": loose, "tight": tight, "in_place": _fit(rank, world, tight["limit"], WideInPlace)}


def _reference(make: type = Wide) -> dict:
    model = make()
    quiet_trainer("auto", 1, max_steps=2).fit(model, _loader())
    return {n: q.detach() for n, q in model.named_parameters()}


def _check_trained(runs: list[dict], ref: dict) -> None:
    assert len({r["label"] for r in runs}) == 1, "every rank must choose the same schedule"
    merged = {n: v for r in runs for n, v in r["params"].items()}
    assert set(merged) == set(ref)
    for name, value in merged.items():
        torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=1e-6, msg=name)
    assert not any(r["left_wrapped"] for r in runs), "teardown puts the blocks back"
    for r in runs:  # a checkpointed block runs twice per micro-batch (F and B's recompute), a plain one once
        twice = r["checkpointing"] is not None  # "selective" recomputes the Tanh too
        assert r["wrapped"] and all(w == twice for w in r["wrapped"].values()), (r["label"], r["wrapped"])
        assert r["forwards"] == {i: (2 if twice else 1) * r["m"] for i in r["wrapped"]}, (r["label"], r["forwards"])


@pytest.mark.dist
def test_a_limit_only_checkpointing_meets_trains_checkpointed_like_one_process(request):
    runs = launch(request, 2, {request.node.name: (_loose_then_tight, ())}, timeout=600)[request.node.name]
    ref = _reference()
    loose, tight = [r["loose"] for r in runs], [r["tight"] for r in runs]
    _check_trained(loose, ref)  # whatever it chose (timings decide; the search test pins the choice)
    _check_trained(tight, ref)
    for r in tight:
        assert r["full"] < r["limit"] < r["plain"], r  # nothing plain fits, something checkpointed does
        # selective or full, whichever the clock found faster within the limit (the search test pins that)
        assert r["checkpointing"] in ("selective", "full") and r["peak"] <= r["limit"], r["label"]
    # selective cannot run WideInPlace's blocks: left out with a warning, not a crash at the first B
    in_place = [r["in_place"] for r in runs]
    _check_trained(in_place, _reference(WideInPlace))
    for r in in_place:
        assert r["modes"] == ["None", "full"] and r["checkpointing"] == "full", (r["modes"], r["label"])
    assert any("leaves activation_checkpointing='selective' out" in m for m in in_place[0]["said"]), in_place[0]


def test_auto_checkpointing_refuses_a_model_whose_hugging_face_switch_is_on() -> None:
    """The switch checkpoints its blocks whatever 'auto' picks: the plain profile would not be plain."""
    from lightning_twobp.lightning.checkpointing import check_auto_with_switches

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    check_auto_with_switches(model)  # no switch: nothing to say
    model[1].gradient_checkpointing = True  # what gradient_checkpointing_enable() sets on a 5.x block
    with pytest.raises(ValueError, match=r"gradient_checkpointing_disable\(\).*activation_checkpointing=None"):
        check_auto_with_switches(model)
